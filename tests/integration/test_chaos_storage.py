"""storage-flaky really injects: a worker-like process whose durable tier is a
``faulty::`` URL (opened through the fsspec entry point, no plan passed)
takes the harness's control request, its uploads fail, retry and are torn
while the fault lasts, and go through again once it is cleared; no version
that storage shows as complete is damaged."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from resilient.events import read_events
from resilient_chaos.injectors import ControlRequest, InjectionFailed

# Saves a small state every ~50 ms into URL, with the chaos hooks of a worker.
CONSUMER = """
import sys, time
from datetime import timedelta
import torch
from resilient.events import EventLog
from resilient.snapshot import RetryPolicy, Snapshotter
from resilient_chaos.hooks import WorkerHooks
run, control, url = sys.argv[1:4]
log = EventLog(run + "/events.jsonl", node="n0", rank=0)
WorkerHooks(control, log, 0, model=None, flips=[], step_of=lambda: 0).watcher.start()
retry = RetryPolicy(initial=timedelta(milliseconds=2), maximum=timedelta(milliseconds=20),
                    deadline=timedelta(seconds=60), attempts=10000)
snap = Snapshotter(url, events=log, retry=retry, chunk_bytes=512, part_bytes=2048, keep_last=3)
step = 0
while True:
    step += 1
    snap.save(step, {"w": torch.full((20, 20), float(step)), "b": torch.arange(64.0) * step})
    snap.wait(timedelta(seconds=120))
    time.sleep(0.05)
"""


def _events(run: Path, kind: str, after: float = 0.0) -> list[dict]:
    path = run / "events.jsonl"
    return [e for e in read_events(path) if e["event"] == kind and e["time"] > after] if path.exists() else []


def _wait_for(fn, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def consumer(tmp_path):
    procs = []

    def start(url: str) -> tuple[Path, Path, subprocess.Popen]:
        run, control = tmp_path / "run", tmp_path / "run" / "chaos" / "control"
        control.mkdir(parents=True)
        procs.append(subprocess.Popen([sys.executable, "-c", CONSUMER, str(run), str(control), url]))
        _wait_for(lambda: _events(run, "commit") or _events(run, "upload"), "the first upload", 120)
        return run, control, procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def test_faulty_url_opens_through_the_entry_point_in_a_fresh_process(tmp_path):
    code = ("import fsspec; fs, root = fsspec.core.url_to_fs('faulty::file://%s'); "
            "print(type(fs).__module__, type(fs).__name__, fs.plan.users)" % tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["resilient_chaos.faultyfs", "FaultyFileSystem", "1"]


@pytest.mark.slow
def test_storage_errors_and_torn_writes_are_injected_retried_and_never_visible(consumer, tmp_path):
    run, control, proc = consumer(f"faulty::file://{tmp_path}/ck")
    for mode, effect in (("errors", "error:"), ("torn-write", "torn_write")):
        inj = ControlRequest("storage-flaky", control, run, params={"mode": mode, "probability": 0.7},
                             ack_timeout=timedelta(seconds=60))
        rec = inj.inject()
        assert rec.status == "injected" and "node n0" in rec.detail
        assert inj.ack["effect"].startswith(effect), inj.ack  # acknowledged only once the wrapper struck
        t0 = rec.injected_at
        errs = _wait_for(lambda: [e for e in _events(run, "upload_error", t0) if e.get("retrying")], f"{mode}: retried upload errors")
        assert "InjectedFault" in errs[0]["error"] or "torn write" in errs[0]["error"]
        inj.clear()
        t1 = time.time()
        # Cleared: uploads go through again without a single retry.
        _wait_for(lambda: [e for e in _events(run, "upload", t1 + 1.0) if e.get("retries") == 0], f"{mode}: clean uploads after clear")
    proc.kill()  # stop writing (and retiring old versions) before reading back
    proc.wait(10)
    from resilient.snapshot import SnapshotReader
    import torch
    r = SnapshotReader(f"file://{tmp_path}/ck")
    steps = r.complete_steps()
    assert steps
    for step in steps:  # every version storage shows as complete reads back whole and right
        m = r.manifest(step)
        assert torch.equal(r.read_region(m, "w"), torch.full((20, 20), float(step)))
    from resilient_chaos.properties import durable_versions_whole
    assert durable_versions_whole(f"file://{tmp_path}/ck").ok  # every chunk's checksum too


@pytest.mark.slow
def test_storage_fault_is_refused_where_the_durable_tier_is_not_faulty(consumer, tmp_path):
    run, control, _ = consumer(f"file://{tmp_path}/ck")
    inj = ControlRequest("storage-flaky", control, run, params={"mode": "errors", "probability": 1.0},
                         ack_timeout=timedelta(seconds=60))
    with pytest.raises(InjectionFailed, match="not a faulty:: URL"):
        inj.inject()


def test_a_damaged_complete_version_fails_the_durable_property(tmp_path):
    import torch

    from resilient.snapshot import Snapshotter
    from resilient_chaos.properties import durable_versions_whole
    url = f"file://{tmp_path}/ck"
    snap = Snapshotter(url, chunk_bytes=512, part_bytes=2048, keep_last=5)
    for step in (1, 2):
        snap.save(step, {"w": torch.full((20, 20), float(step))})
        assert snap.wait(timedelta(seconds=60))
    snap.close()
    good = durable_versions_whole(url)
    assert good.ok and "2 complete versions" in good.detail
    victim = sorted(p for p in (tmp_path / "ck").rglob("*.bin") if "step-000000000002" in str(p))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10  # a torn write that storage reported whole
    victim.write_bytes(bytes(data))
    bad = durable_versions_whole(url)
    assert not bad.ok and "step 2" in bad.detail and "1 of 2" in bad.detail
