"""Process injectors act on real child processes, and the effect is observed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest

from resilient.events import EventLog
from resilient_chaos.injectors import (
    Action, ControlRequest, EtcdMemberLoss, HangProcess, InjectionFailed, KillProcess, Preempt, emit_record,
)
from resilient_chaos.timeline import load_timeline

SLEEPER = "import time\nwhile True: time.sleep(0.05)"
# Counts up in a file: progress stops while the process is stopped.
COUNTER = "import sys, time\nn = 0\nwhile True:\n    n += 1\n    open(sys.argv[1], 'w').write(str(n))\n    time.sleep(0.01)"
# An "agent" with two "workers" under it.
TREE = (
    "import subprocess, sys, time\n"
    "kids = [subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.05)']) for _ in range(2)]\n"
    "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
    "while True: time.sleep(0.05)"
)
GRACEFUL = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)"


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(code: str, *args: str, stdout=None) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=stdout, text=True)
        procs.append(p)
        return p

    yield start
    for p in procs:
        try:
            for kid in psutil.Process(p.pid).children(recursive=True):
                kid.kill()
        except psutil.NoSuchProcess:
            pass
        if p.poll() is None:
            p.kill()
        p.wait(10)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill_worker(spawn):
    p = spawn(SLEEPER)
    rec = KillProcess(p.pid, target="rank:0").inject()
    assert rec.status == "injected" and rec.pids == [p.pid]
    assert p.wait(5) == -signal.SIGKILL


def test_kill_node_tree_and_its_shm(spawn, tmp_path):
    agent = spawn(TREE, stdout=subprocess.PIPE)
    workers = [int(x) for x in agent.stdout.readline().split()]
    shm = tmp_path / "rsnap-node1"
    shm.write_bytes(b"state")
    inj = KillProcess(lambda: agent.pid, tree=True, shm_paths=[str(shm)], target="node:1")
    assert inj.kind == "kill-node"
    rec = inj.inject()
    assert set(rec.pids) == {agent.pid, *workers}
    assert agent.wait(5) == -signal.SIGKILL
    assert all(gone(w) for w in workers)
    assert not shm.exists()


def test_kill_stale_pid_is_an_error(spawn):
    p = spawn(SLEEPER)
    p.kill()
    p.wait(5)
    with pytest.raises(InjectionFailed, match="does not exist"):
        KillProcess(p.pid).inject()
    with pytest.raises(InjectionFailed, match="no pid"):
        KillProcess(lambda: []).inject()


def test_hang_stops_progress_then_resumes(spawn, tmp_path):
    counter = tmp_path / "n"
    p = spawn(COUNTER, str(counter))
    deadline = time.monotonic() + 10
    while not counter.exists() or not counter.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with HangProcess(p.pid, target="rank:0") as inj:
        assert psutil.Process(p.pid).status() == psutil.STATUS_STOPPED
        frozen = counter.read_text()
        time.sleep(0.3)
        assert counter.read_text() == frozen  # no progress while hung
    assert inj.record.status == "cleared"
    assert psutil.Process(p.pid).status() != psutil.STATUS_STOPPED
    deadline = time.monotonic() + 10
    while counter.read_text() in ("", frozen):
        assert time.monotonic() < deadline, "no progress after SIGCONT"
        time.sleep(0.01)


def test_preemption_graceful_exit(spawn):
    p = spawn(GRACEFUL, stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == "ready"
    inj = Preempt(p.pid, grace=timedelta(seconds=5))
    inj.inject()
    assert inj.wait() == "exited within the grace period"
    assert p.wait(5) == 0
    assert "exited within the grace period" in inj.record.detail


def test_preemption_kills_after_grace(spawn):
    p = spawn(STUBBORN, stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == "ready"
    grace = timedelta(seconds=0.5)
    inj = Preempt(p.pid, grace=grace)
    t0 = time.monotonic()
    inj.inject()
    assert "SIGKILL after grace" in inj.wait()
    assert time.monotonic() - t0 >= grace.total_seconds()
    assert p.wait(5) == -signal.SIGKILL


class FakeMember:
    """Stands in for the etcd server wrapper: stop()/start() a real process."""

    def __init__(self, spawn):
        self.spawn, self.proc = spawn, spawn(SLEEPER)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def start(self) -> None:
        self.proc = self.spawn(SLEEPER)


def test_etcd_member_loss_object_and_pid(spawn):
    m = FakeMember(spawn)
    first = m.pid
    with EtcdMemberLoss([m], target="etcd:0"):
        assert gone(first)
    assert m.pid != first and not gone(m.pid)

    p = spawn(SLEEPER)
    restarted = []

    def restart(old: int) -> int:
        restarted.append(spawn(SLEEPER).pid)
        return restarted[-1]

    inj = EtcdMemberLoss([p.pid], restart=restart)
    inj.inject()
    assert p.wait(5) == -signal.SIGKILL
    inj.clear()
    assert len(restarted) == 1 and not gone(restarted[0])


def test_etcd_member_that_will_not_stop_fails():
    class Stuck:
        def stop(self): pass
        def start(self): pass
        def is_running(self): return True

    with pytest.raises(InjectionFailed, match="still serving"):
        EtcdMemberLoss([Stuck()], settle=timedelta(seconds=0.2)).inject()


CONSUMER = """
import json, pathlib, sys, time
from resilient.events import EventLog
control, run = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
log = EventLog(run / "node0" / "events.jsonl", node="node0", rank=1)
done = set()
while True:
    for req in control.glob("*.json"):
        body = json.loads(req.read_text())
        if body["id"] not in done:
            done.add(body["id"])
            log.emit("fault_injected", request=body["id"], fault=body["kind"], bit=body["params"]["bit"])
    time.sleep(0.02)
"""


def test_control_request_acknowledged_by_consumer(spawn, tmp_path):
    control, run = tmp_path / "control", tmp_path / "run"
    control.mkdir()
    spawn(CONSUMER, str(control), str(run))
    inj = ControlRequest("bitflip", control, run, params={"bit": 30}, target="rank:1", ack_timeout=timedelta(seconds=20))
    rec = inj.inject()
    assert rec.status == "injected" and "rank 1" in rec.detail
    assert json.loads(inj.request_path.read_text())["params"] == {"bit": 30}
    assert inj.ack["bit"] == 30
    inj.clear()
    assert not inj.request_path.exists() and (control / f"{inj.fault_id}.clear").exists()


def test_control_request_without_consumer_fails(tmp_path):
    inj = ControlRequest("storage-flaky", tmp_path / "c", tmp_path / "r", ack_timeout=timedelta(seconds=0.3))
    with pytest.raises(InjectionFailed, match="no consumer acknowledged"):
        inj.inject()
    assert not inj.request_path.exists()


def test_action_and_records_in_timeline(spawn, tmp_path):
    box = {}
    inj = Action("scale-up", do=lambda: box.setdefault("p", spawn(SLEEPER)).pid, check=lambda: "p" in box and not gone(box["p"].pid), target="node:2")
    rec = inj.inject()
    with EventLog(tmp_path / "chaos" / "events.jsonl", node="chaos") as log:
        emit_record(log, rec)
        emit_record(log, inj.clear(), cleared=True)
    tl = load_timeline(tmp_path)
    assert [e["event"] for e in tl] == ["fault_injected", "fault_cleared"]
    assert tl[0]["fault"] == "scale-up" and tl[0]["target"] == "node:2"
    with pytest.raises(InjectionFailed, match="not observed"):
        Action("scale-down", do=lambda: None, check=lambda: False, settle=timedelta(seconds=0.1)).inject()
