"""A version of a future that a rollback abandoned, put back genuine (its MACs intact), is refused.

A rollback deletes the newer versions of every tier and raises the run's epoch
(:mod:`resilient.snapshot.epoch`); rank 0 stamps the epoch it knows in the manifests it
signs. So a version made before a rollback that kept only older steps cannot come back:

- by storage access: a durable version saved before the rollback and written back after it;
- by a kept node store: the tree a dead agent left still holds versions past the floor, and a
  relaunch adopts it (those versions have no commit record: only their manifests can say);

while a version written after the rollback (the new epoch) above the same floor loads. And a
kept tree vouches only for the ranks whose files it holds, not for every rank of the version.
"""

from __future__ import annotations

import shutil
import time
from datetime import timedelta

import pytest
import torch

from resilient.agent.membership import registry_prefix
from resilient.agent.store import kept_versions
from resilient_chaos.etcd_testing import unique_run_id
from resilient.events import EventLog, read_events
from resilient.ledger import run_copies
from resilient.secret import COMMIT, REGISTRY
from resilient.snapshot import Snapshotter
from resilient.snapshot.auth import SnapshotAbandoned, admit
from resilient.snapshot.commits import REPLICATED, abandon_commits_after, read_run_epoch
from resilient.snapshot.epoch import Epoch, epoch_key, epoch_ledger
from resilient.snapshot.format import version_dir
from resilient.snapshot.memcommit import commit_key
from resilient.snapshot.restore import restore_candidates
from resilient.snapshot.tiers import StoreInfo, memory_plan, tiered_candidates

pytestmark = pytest.mark.timeout(120)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(32, 16, generator=g)}, "step": seed}


def _abandoned(events_path) -> list[dict]:
    return [e for e in read_events(events_path) if e["event"] == "auth_failure"
            and e["what"] == "abandoned snapshot version"]


def test_an_abandoned_durable_version_put_back_is_refused(tmp_path, job):
    run, secret = job
    url, copies = (tmp_path / "ckpt").as_uri(), run_copies(run)
    log = EventLog(tmp_path / "events.jsonl", node="test")
    with Snapshotter(url, secret=secret, compress="none", keep_last=10) as snap:
        for step in (2, 4, 6):
            snap.save(step, _state(step), force=True)
            snap.wait()   # (a capture while both buffers are busy is skipped)
        saved = tmp_path / "saved-step-6"
        shutil.copytree(tmp_path / "ckpt" / version_dir(6), saved)   # what a storage writer keeps
        # an SDC rollback to step 4, as rank 0 makes it: the epoch first, then the newer versions go
        epoch_ledger(None, secret, copies).write(epoch_key("r"), {**Epoch().rolled_back(4).to_doc(), "time": 0})
        assert snap.drop_after(4) == [6]
    shutil.copytree(saved, tmp_path / "ckpt" / version_dir(6))          # ... and puts back later

    epoch = read_run_epoch(None, "r", secret, copies)
    assert epoch.gen == 1
    with Snapshotter(url, secret=secret) as snap:
        reader = snap.reader()
        assert reader.complete_steps() == [2, 4, 6]   # genuine: every MAC verifies
        with pytest.raises(SnapshotAbandoned, match="abandoned"):
            admit(epoch, reader.manifest(6), "step 6")
        target = _state(0)
        got = restore_candidates([(s, reader, "durable") for s in (6, 4, 2)], target, rank=0, events=log, epoch=epoch)
        assert got.step == 4 and torch.equal(target["model"]["w"], _state(4)["model"]["w"])
        assert [e["key"].rsplit("/", 2)[-2] for e in _abandoned(log.path)] == [version_dir(6)]

        # the run went on in epoch 1: its own step 6 is no abandoned future and loads
        snap.epoch = epoch.gen
        snap.save(6, _state(60), force=True)
        snap.wait()
        got = restore_candidates([(6, snap.reader(), "durable")], target, rank=0, events=log, epoch=epoch)
        assert got.step == 6 and torch.equal(target["model"]["w"], _state(60)["model"]["w"])
    log.close()


@pytest.mark.etcd
def test_a_kept_node_store_does_not_resurrect_an_abandoned_version(etcd, tmp_path, job):
    run, secret = job
    run_id, copies = unique_run_id(), run_copies(run)
    log = EventLog(tmp_path / "events.jsonl", node="a")
    secret_file = tmp_path / "worker.secret"
    secret_file.write_text(secret.material.hex())
    info = StoreInfo(base=str(tmp_path / "shm"), run_id=run_id, node="a", etcd=etcd.endpoint,
                     secret_file=str(secret_file))
    store = info.store
    store.create()
    try:
        with Snapshotter(store.url, commit=False, secret=secret, compress="none") as snap:
            for step in (4, 6):
                snap.save(step, _state(step), force=True)
                snap.wait()
        with etcd.client(retry_timeout=timedelta(seconds=10)) as client:
            # a rollback to step 4 while the tree held step 6 (the agent died before its retention
            # removed it), then a relaunch that adopted the tree and lists it in its registry entry
            assert abandon_commits_after(client, run_id, secret, 4, copies, log).gen == 1
            store.adopted = store.versions()
            key = registry_prefix(run_id) + "a"
            client.put(key, secret.seal_record(REGISTRY, key, {"node": "a", "store": "", "since": time.time(),
                                                                "kept": kept_versions(store)}))
            candidates, readers, epoch = tiered_candidates(info, None, log, secret.material, copies)
            assert [(s, tier) for s, _, tier in candidates] == [(6, "memory"), (4, "memory")] and epoch.gen == 1
            target = _state(0)
            got = restore_candidates(candidates, target, rank=0, events=log, epoch=epoch)
            for r in readers:
                r.close()
            assert got.step == 4 and torch.equal(target["model"]["w"], _state(4)["model"]["w"])
            (report,) = _abandoned(log.path)
            assert report["key"] == "memory://%s/step-6/manifest" % run_id

            # Kept trees of b (rank 0 of step 10) and c (rank 1), both relaunched after the commit
            # that named each as a holder of both ranks: each counts for the rank it holds only.
            for node, rank in (("b", 0), ("c", 1)):
                k = registry_prefix(run_id) + node
                client.put(k, secret.seal_record(REGISTRY, k, {
                    "node": node, "store": f"127.0.0.1:{ord(node)}", "since": time.time(),
                    "kept": [{"step": 10, "attempt": "x-000001", "world": 2, "ranks": [rank]}]}))
            ck = commit_key(run_id, REPLICATED, 10)
            client.put(ck, secret.seal_record(COMMIT, ck, {
                "step": 10, "attempt": "x-000001", "world": 2, "k": 1, "holders": {"0": ["b", "c"], "1": ["c", "b"]},
                "time": time.time() - 60, "epoch": 1}))
            (plan, *_) = memory_plan(info, events=log, copies=copies)
            assert plan["step"] == 10 and plan["holders"] == {"0": ["b"], "1": ["c"]}
    finally:
        store.remove()
        log.close()
