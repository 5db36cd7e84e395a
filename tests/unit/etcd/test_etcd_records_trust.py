"""Everything read back from etcd is authenticated before use (real etcd): forged or tampered
commit records, holds and quarantine records are reported (``auth_failure``) and ignored,
and never select a version, a holder or a quarantine state."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from resilient.agent.membership import registry_prefix
from resilient.agent.quarantine import NodeQuarantined, Quarantine
from resilient.commands.quarantine import main as quarantine_cli
from resilient_chaos.etcd_testing import unique_run_id
from resilient.events import EventLog, read_events
from resilient.secret import COMMIT, HOLDS, QUARANTINE, REGISTRY, JobSecret, JobSecretError
from resilient.snapshot.commits import LOCAL, REPLICATED
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions, commit_key, holds_prefix
from resilient.snapshot.nodestore import LocalVersion, NodeStore
from resilient.snapshot.tiers import StoreInfo, memory_plan

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

SECRET = JobSecret(b"j" * 48)
OTHER_JOB = JobSecret(b"o" * 48)


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


@pytest.fixture
def events(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", node="test")
    yield log
    log.close()


def auth_failures(log: EventLog) -> dict[str, str]:
    return {e["key"]: e["what"] for e in read_events(log.path) if e["event"] == "auth_failure"}


def _forgeries(secret: JobSecret, purpose: str, doc: dict, donor_key: str) -> list:
    """What an etcd writer without the job secret can put under a key: ``(key) -> value`` each."""
    def edited(key: str) -> str:
        good = json.loads(secret.seal_record(purpose, key, doc))
        return json.dumps({**good, "step": 10 ** 6} if "step" in doc else {**good, "x": 1})
    return [
        lambda key: json.dumps(doc),                               # plain JSON
        lambda key: OTHER_JOB.seal_record(purpose, key, doc),      # another job's MAC
        lambda key: secret.seal_record(purpose, donor_key, doc),   # a genuine record moved from another key
        edited,                                                    # a genuine record, edited
        lambda key: "\x00not json",
    ]


# ------------------------------------------------------------ commit records
def test_forged_commit_records_never_select_a_version(etcd, client, events, tmp_path):
    """A genuine step 5 and, for a newer step each, every kind of forgery: the plan holds step 5 only."""
    run_id = unique_run_id()
    (tmp_path / "secret").write_text(SECRET.material.hex())
    info = StoreInfo(base=str(tmp_path / "shm"), run_id=run_id, node="a", etcd=etcd.endpoint,
                     secret_file=str(tmp_path / "secret"))
    for node in ("a", "b"):
        key = registry_prefix(run_id) + node
        client.put(key, SECRET.seal_record(REGISTRY, key, {"node": node, "store": f"127.0.0.1:{ord(node)}",
                                                           "since": 0}))
    record = {"step": 5, "attempt": "x-000001", "world": 2, "k": 1, "holders": {"0": ["a", "b"], "1": ["b", "a"]},
              "time": 1.0}
    client.put(commit_key(run_id, REPLICATED, 5), SECRET.seal_record(COMMIT, commit_key(run_id, REPLICATED, 5), record))
    forged_keys = []
    for i, forge in enumerate(_forgeries(SECRET, COMMIT, {**record, "step": 9}, commit_key(run_id, REPLICATED, 5))):
        forged_keys.append(commit_key(run_id, REPLICATED, 9 + i))
        client.put(forged_keys[-1], forge(forged_keys[-1]))
    # a forged registry entry cannot make a holder live either
    ghost = registry_prefix(run_id) + "ghost"
    client.put(ghost, json.dumps({"node": "ghost", "store": "10.6.6.6:1", "since": 0}))
    plan = memory_plan(info, events=events)
    assert [p["step"] for p in plan] == [5]
    assert plan[0]["peers"] == {"a": "127.0.0.1:97", "b": "127.0.0.1:98"}
    assert set(auth_failures(events)) == set(forged_keys) | {ghost}


# ------------------------------------------------------------ holds
def test_forged_holds_never_count_as_copies(client, events, tmp_path):
    """Node a holds rank 0; forged holds claim rank 1 on node x: no commit can follow from them."""
    run_id = unique_run_id()
    store = NodeStore(tmp_path / "shm", run_id, "a")
    store.create()
    rep = Replicator(store, client, run_id, "a", SECRET, lambda: {}, ReplicatorOptions(), events)
    try:
        v = LocalVersion(step=3, attempt="x-000001", ranks=frozenset({0}), mtime=0.0)
        prefix = holds_prefix(run_id, 3)
        doc = {"attempt": v.attempt, "world": 2, "holders": {"1": ["x"]}}
        for i, forge in enumerate(_forgeries(SECRET, HOLDS, doc, prefix + "a")):
            client.put(prefix + f"x{i}", forge(prefix + f"x{i}"))
        merged = rep.protocol.hold(v, {0: ["a"]}, world=2)
        assert merged == {"0": ["a"]}
        rep._commit(v, 2, merged, {LOCAL: 0, REPLICATED: 0})
        assert client.get(commit_key(run_id, LOCAL, 3)) is None  # rank 1 is held nowhere
        assert len(auth_failures(events)) == 5
        # the genuine record this node wrote authenticates
        assert SECRET.open_record(HOLDS, prefix + "a", client.get(prefix + "a").value)["holders"] == {"0": ["a"]}
    finally:
        rep.close()
        store.remove()


# ------------------------------------------------------------ quarantine
def test_forged_quarantine_records_neither_quarantine_nor_hide(client, events):
    run_id = unique_run_id()
    q = Quarantine(client, run_id, SECRET, events)
    q.add("bad", reason="sdc", device="bad:0")
    with pytest.raises(NodeQuarantined, match="'bad' is quarantined"):
        q.refuse_if_quarantined("bad", "127.0.0.1:1")
    # forged records for healthy nodes: ignored, reported, the nodes start
    for i, forge in enumerate(_forgeries(SECRET, QUARANTINE, {"node": "ok", "time": 1.0, "reason": "forged"},
                                         q.prefix + "bad")):
        client.put(q.prefix + f"ok{i}", forge(q.prefix + f"ok{i}"))
        q.refuse_if_quarantined(f"ok{i}", "127.0.0.1:1")
        assert q.get(f"ok{i}") is None
    good, forged = q.scan()
    assert set(good) == {"bad"} and set(forged) == {f"ok{i}" for i in range(5)}
    # a forged "clear" written over the genuine record is no record: the node stays out
    # only while the genuine one is there, so the forgery is reported, not believed
    client.put(q.prefix + "bad", json.dumps({"node": "bad", "cleared": True}))
    assert q.get("bad") is None and (q.prefix + "bad") in auth_failures(events)


def test_quarantine_cli_verifies_with_the_jobs_secret(etcd, client, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RESILIENT_JOB_SECRET", raising=False)
    monkeypatch.delenv("RESILIENT_JOB_SECRET_FILE", raising=False)
    run_id = unique_run_id()
    secret_file = tmp_path / "job.secret"
    secret_file.write_text(SECRET.material.decode())
    secret_file.chmod(0o600)
    q = Quarantine(client, run_id, SECRET)
    q.add("bad", reason="sdc")
    client.put(q.prefix + "forged", json.dumps({"node": "forged", "time": 1.0}))
    argv = ["--rdzv-endpoint", etcd.endpoint, "--run-id", run_id]
    with pytest.raises(JobSecretError):
        quarantine_cli(["list", *argv])
    assert quarantine_cli(["list", *argv, "--run-dir", str(tmp_path)]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(ln["node"], "unauthentic" in ln) for ln in lines] == [("bad", False), ("forged", True)]
    with pytest.raises(JobSecretError):  # a clear is a newer sealed record, not a delete: it needs the secret
        quarantine_cli(["clear", "bad", *argv])
    assert quarantine_cli(["clear", "bad", *argv, "--secret-file", str(secret_file)]) == 0
    assert q.get("bad") is None
