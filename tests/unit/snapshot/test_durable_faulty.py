"""Flaky storage (chaos/faultyfs.py over file://): retries, outages, lying disks, bad reads."""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta

import pytest
import torch

from resilient.events import EventLog, read_events
from resilient.snapshot import RetryPolicy, SnapshotCorrupt, Snapshotter, SnapshotReader
from resilient_chaos.faultyfs import FaultPlan, FaultyFileSystem

FAST_RETRY = RetryPolicy(initial=timedelta(milliseconds=2), maximum=timedelta(milliseconds=50),
                         deadline=timedelta(seconds=20), attempts=40)


def state(step: int) -> dict:
    return {"w": torch.full((50, 40), float(step)), "b": torch.arange(100.0) * step}


def blank() -> dict:
    return {"w": torch.zeros(50, 40), "b": torch.zeros(100)}


def snapper(tmp_path, plan: FaultPlan, **kw) -> tuple[Snapshotter, str]:
    url = f"faulty::file://{tmp_path}/ck"
    events = EventLog(tmp_path / "e.jsonl")
    return Snapshotter(url, storage_options={"faulty": {"plan": plan}}, events=events, retry=FAST_RETRY,
                       chunk_bytes=1024, part_bytes=4096, keep_last=10, **kw), url


def test_errors_and_torn_writes_are_retried_and_every_visible_version_is_whole(tmp_path):
    plan = FaultPlan(error_rate=0.25, torn_write_rate=0.2, seed=3)
    snap, url = snapper(tmp_path, plan)
    for step in range(1, 6):
        snap.save(step, state(step))
        assert snap.wait(timedelta(seconds=60))
    snap.close()
    assert plan.injected["torn_write"] > 0 and any(k.startswith("error:") for k in plan.injected)
    plan.enabled = False
    r = SnapshotReader(url, storage_options={"faulty": {"plan": plan}})
    assert r.complete_steps() == [1, 2, 3, 4, 5]
    for step in r.complete_steps():
        m = r.manifest(step)
        assert torch.equal(r.read_region(m, "w"), state(step)["w"])
    ups = [e for e in read_events(tmp_path / "e.jsonl") if e["event"] == "upload"]
    assert sum(e["retries"] for e in ups) > 0


def test_silently_torn_writes_are_caught_by_the_size_check(tmp_path):
    plan = FaultPlan(torn_write_rate=0.3, silent_torn=True, seed=5)
    snap, url = snapper(tmp_path, plan)
    for step in (1, 2, 3):
        snap.save(step, state(step))
        assert snap.wait(timedelta(seconds=60))
    snap.close()
    assert plan.injected["torn_write"] > 0
    plan.enabled = False
    got = blank()
    assert Snapshotter(url, storage_options={"faulty": {"plan": plan}}).restore(got).step == 3
    assert torch.equal(got["w"], state(3)["w"])


def test_outage_never_blocks_or_kills_training_and_recovery_commits(tmp_path):
    plan = FaultPlan(error_rate=1.0)
    snap, url = snapper(tmp_path, plan)
    # Uploads are held at their first storage fault until the saves have returned: a save
    # that waited for its upload would never return (and the test would time out).
    held, main, on_main = threading.Event(), threading.current_thread(), []

    def hold(what: str, path: str) -> None:
        if threading.current_thread() is main:
            on_main.append(path)
        else:
            held.wait(timedelta(seconds=60).total_seconds())

    unlisten = plan.listen(hold)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in (1, 2, 3):
                assert snap.save(step, state(step))
            assert not on_main  # saves return after the host copy: storage is the uploader's
            assert not [e for e in read_events(tmp_path / "e.jsonl") if e["event"] == "upload_error"
                        and not e.get("retrying")]
        finally:
            held.set()
            unlisten()
        snap.wait(timedelta(seconds=60))
    assert any("training goes on" in str(w.message) for w in caught)
    errs = [e for e in read_events(tmp_path / "e.jsonl") if e["event"] == "upload_error" and not e.get("retrying")]
    assert errs and errs[0]["phase"] == "upload" and "StorageError" in errs[0]["error"]
    plan.enabled = False
    snap.save(4, state(4))
    assert snap.wait(timedelta(seconds=30)) and snap.committed_step == 4
    snap.close()
    assert SnapshotReader(f"file://{tmp_path}/ck").complete_steps() == [4]


def test_bits_flipped_in_transit_are_reread_and_on_disk_damage_is_refused(tmp_path):
    plan = FaultPlan()
    snap, url = snapper(tmp_path, plan)
    snap.save(1, state(1))
    snap.close()
    opts = {"faulty": {"plan": plan}}
    plan.corrupt_read_rate = 0.3  # occasional flips: the second read of a chunk is right
    plan.seed = 11
    got = blank()
    assert Snapshotter(url, storage_options=opts).restore(got).step == 1
    assert torch.equal(got["b"], state(1)["b"])
    plan.corrupt_read_rate = 1.0  # every read is bad: refused, model untouched
    got = blank()
    with pytest.raises(SnapshotCorrupt):
        Snapshotter(url, storage_options=opts).restore(got)
    assert not got["w"].any()
    assert plan.injected["corrupt_read"] > 0


def test_faulty_fs_wraps_an_instance_directly(tmp_path):
    import fsspec
    fs = FaultyFileSystem(fsspec.filesystem("file"), torn_write_rate=1.0, seed=1)
    with pytest.raises(OSError, match="torn"):
        fs.pipe_file(f"{tmp_path}/x", b"0123456789")
    assert len((tmp_path / "x").read_bytes()) < 10
