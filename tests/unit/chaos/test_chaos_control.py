"""Control requests reach a watcher inside the 'job' and really make a
FaultyFileSystem misbehave, until cleared."""

from __future__ import annotations

import time
from datetime import timedelta

import fsspec
import pytest

from resilient.events import EventLog
from resilient_chaos.control import ControlWatcher, faultyfs_handler
from resilient_chaos.faultyfs import FaultyFileSystem, InjectedFault
from resilient_chaos.injectors import ControlRequest, InjectionFailed


@pytest.fixture
def setup(tmp_path):
    run, control = tmp_path / "run", tmp_path / "run" / "control"
    fs = FaultyFileSystem(fsspec.filesystem("file"))
    log = EventLog(run / "node0" / "events.jsonl", node="node0", rank=0)

    def boom(req):
        raise RuntimeError("no tensor named nope")

    watcher = ControlWatcher(control, log, {"storage-flaky": faultyfs_handler(fs), "bitflip": boom},
                             interval=timedelta(milliseconds=20)).start()
    yield run, control, fs, tmp_path / "data"
    watcher.stop()
    log.close()


def test_storage_errors_until_cleared(setup):
    run, control, fs, data = setup
    fs.pipe_file(str(data / "a"), b"ok")
    inj = ControlRequest("storage-flaky", control, run, params={"mode": "errors", "probability": 1.0}, ack_timeout=timedelta(seconds=20))
    rec = inj.inject()
    assert rec.status == "injected" and "node0" in rec.detail
    with pytest.raises(InjectedFault):
        fs.pipe_file(str(data / "b"), b"lost")
    inj.clear()
    deadline = time.monotonic() + 20
    while fs.plan.error_rate:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    fs.pipe_file(str(data / "c"), b"ok again")
    assert fs.cat_file(str(data / "c")) == b"ok again"


def test_latency_mode(setup):
    run, control, fs, _ = setup
    with ControlRequest("storage-flaky", control, run, params={"mode": "latency", "latency_ms": 50}, ack_timeout=timedelta(seconds=20)):
        assert fs.plan.latency == timedelta(milliseconds=50)


def test_handler_failure_fails_the_injection_fast(setup):
    run, control, _, _ = setup
    inj = ControlRequest("bitflip", control, run, params={"name": "nope"}, ack_timeout=timedelta(seconds=20))
    with pytest.raises(InjectionFailed, match="refused by node node0: RuntimeError: no tensor named nope"):
        inj.inject()
