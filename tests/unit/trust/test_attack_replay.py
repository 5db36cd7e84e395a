"""Replay by another local user who can write the job's etcd (an external etcd without
authentication, reached over loopback) but has neither the job secret nor the run dir: genuine
records it saved and puts back, or deletes, roll nothing back.

- a quarantine an operator cleared stays cleared when the saved record is written back (and when
  the clear is deleted first); a quarantine deleted from etcd still refuses the node;
- a commit record deleted at a rollback and written back is not restored from, even with the
  epoch record rolled back or deleted in etcd too; a commit racing the rollback is fenced off.
"""

from __future__ import annotations

import base64
import json
import time
from datetime import timedelta

import pytest

from resilient.agent.membership import registry_prefix
from resilient.agent.quarantine import NodeQuarantined, Quarantine
from resilient.commands.quarantine import main as quarantine_cli
from resilient_chaos.etcd_testing import unique_run_id
from resilient.events import EventLog, read_events
from resilient.ledger import run_copies
from resilient.secret import COMMIT, REGISTRY
from resilient.snapshot.commits import REPLICATED, abandon_commits_after
from resilient.snapshot.epoch import EpochFence, epoch_key
from resilient.snapshot.memcommit import commit_key
from resilient.snapshot.tiers import StoreInfo, memory_plan

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


class EtcdWriter:
    """The attacker's hands on etcd: its v3 JSON gateway, from its own process and account."""

    def __init__(self, attacker, endpoint: str):
        self.attacker, self.url = attacker, f"http://{endpoint.split(',')[0].removeprefix('http://')}/v3"

    def _call(self, path: str, body: dict) -> dict:
        r = self.attacker.python("""
            import json, sys, urllib.request
            req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method="POST")
            print(urllib.request.urlopen(req, timeout=20).read().decode())
        """, self.url + path, json.dumps(body))
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def save(self, key: str) -> str | None:
        kvs = self._call("/kv/range", {"key": base64.b64encode(key.encode()).decode()}).get("kvs") or []
        return kvs[0]["value"] if kvs else None   # base64, as etcd gave it

    def put_back(self, key: str, saved_b64: str) -> None:
        self._call("/kv/put", {"key": base64.b64encode(key.encode()).decode(), "value": saved_b64})

    def delete(self, key: str) -> None:
        self._call("/kv/deleterange", {"key": base64.b64encode(key.encode()).decode()})


def test_a_cleared_quarantine_written_back_stays_cleared(attacker, etcd, client, job, capsys):
    run, secret = job
    run_id = unique_run_id()
    hands = EtcdWriter(attacker, etcd.endpoint)
    agent_side = Quarantine(client, run_id, secret, copies=run_copies(run))   # as the agent records it
    agent_side.add("n", reason="sdc", device="n:0")
    key = agent_side.prefix + "n"
    saved = hands.save(key)
    assert saved is not None

    # deleting the record in etcd does not free the node: the run dir's copy still holds it
    hands.delete(key)
    with pytest.raises(NodeQuarantined, match="resilient quarantine clear n"):
        agent_side.refuse_if_quarantined("n", f"--run-dir {run}")

    argv = ["--rdzv-endpoint", etcd.endpoint, "--run-id", run_id, "--run-dir", str(run)]
    assert quarantine_cli(["clear", "n", *argv]) == 0
    assert "cleared 'n'" in capsys.readouterr().out
    for replay in ("over the clear", "after deleting the clear"):
        if replay == "after deleting the clear":
            hands.delete(key)
        hands.put_back(key, saved)
        relaunch = Quarantine(client, run_id, secret, copies=run_copies(run))
        relaunch.refuse_if_quarantined("n", "")          # the node starts
        assert relaunch.all() == {}, replay
    assert quarantine_cli(["list", *argv]) == 0
    assert capsys.readouterr().out == ""
    # what is in etcd is the attacker's replay, genuine but older than the clear in the run dir
    assert json.loads(client.get(key).value)["gen"] < json.loads(
        next((run / "ledger").rglob("n")).read_text())["gen"]


def test_a_commit_record_deleted_at_a_rollback_and_written_back_is_not_restored(attacker, etcd, client, job, tmp_path):
    run, secret = job
    run_id = unique_run_id()
    hands = EtcdWriter(attacker, etcd.endpoint)
    log = EventLog(tmp_path / "events.jsonl", node="test")
    secret_file = tmp_path / "worker.secret"
    secret_file.write_text(secret.material.hex())
    info = StoreInfo(base=str(tmp_path / "shm"), run_id=run_id, node="a", etcd=etcd.endpoint,
                     secret_file=str(secret_file))
    for node in ("a", "b"):
        k = registry_prefix(run_id) + node
        client.put(k, secret.seal_record(REGISTRY, k, {"node": node, "store": f"127.0.0.1:{ord(node)}", "since": 0}))
    committer = EpochFence(client, run_id, secret)   # what the replicator seals and fences its commits with

    def commit(step: int) -> None:
        key = commit_key(run_id, REPLICATED, step)
        assert committer.create({key: secret.seal_record(COMMIT, key, {
            "step": step, "attempt": "x-000001", "world": 2, "k": 1, "holders": {"0": ["a", "b"], "1": ["b", "a"]},
            "time": time.time(), "epoch": committer.epoch.gen})}) == {key}

    for step in (4, 6):
        commit(step)
    copies = run_copies(run)
    assert [p["step"] for p in memory_plan(info, events=log, copies=copies)] == [6, 4]
    abandoned, epoch_before = hands.save(commit_key(run_id, REPLICATED, 6)), hands.save(epoch_key(run_id))
    assert epoch_before is None   # no rollback yet

    # a rollback to step 4 (as rank 0 makes it: resilient.snapshot.tiers.forget_after)
    landed = time.time()
    assert abandon_commits_after(client, run_id, secret, 4, copies, log).gen == 1
    assert [p["step"] for p in memory_plan(info, events=log, copies=copies)] == [4]
    hands.put_back(commit_key(run_id, REPLICATED, 6), abandoned)
    assert [p["step"] for p in memory_plan(info, events=log, copies=copies)] == [4]
    reports = [e for e in read_events(log.path) if e["event"] == "auth_failure"]
    assert {(e["what"], e["key"]) for e in reports} == {("abandoned commit record", commit_key(run_id, REPLICATED, 6))}

    # the committer that knew epoch 0 is fenced off: its commit of a version that landed before
    # the rollback fails, it learns epoch 1 and drops that version; a later one commits in epoch 1
    key = commit_key(run_id, REPLICATED, 5)
    stale = secret.seal_record(COMMIT, key, {"step": 5, "attempt": "x-000001", "world": 2, "k": 1,
                                             "holders": {"0": ["a"], "1": ["b"]}, "time": 1.0, "epoch": 0})
    assert committer.epoch.gen == 0 and committer.create({key: stale}) is None
    assert committer.epoch.gen == 1 and committer.abandons(5, landed) and not committer.abandons(4, landed)
    assert not committer.abandons(5, time.time() + 1)
    commit(5)
    assert [p["step"] for p in memory_plan(info, events=log, copies=copies)] == [5, 4]

    # the epoch rolled back in etcd too (deleted): the run dir's copy still holds it
    hands.delete(epoch_key(run_id))
    assert [p["step"] for p in memory_plan(info, events=log, copies=copies)] == [5, 4]
    log.close()
