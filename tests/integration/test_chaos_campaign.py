"""The fault driver fires planned faults on a live (fake) job at their step or
time, records skips and failures, and the evaluation fails a broken campaign."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from resilient.errors import ConfigError
from resilient_chaos.campaign import FaultDriver, evaluate, make_injector
from resilient_chaos.report import report
from resilient_chaos.scenario import scenario_from_dict

# A stand-in worker: one step event every 50 ms, forever.
TRAINER = """
import sys, time
from resilient.events import EventLog
log = EventLog(sys.argv[1], node=sys.argv[2], rank=int(sys.argv[3]))
log.emit("run_start")
s = 0
while True:
    s += 1
    log.emit("step", step=s, loss=1.0)
    time.sleep(0.05)
"""


class FakeJob:
    """JobHandles for two single-worker 'nodes' (the worker is the node)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.control_dir = run_dir / "control"
        self.etcd_members = []
        self.netlab = None
        self.proxies = {}
        self.durable_path = None
        self.nodes = 2
        self.procs = [
            subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir / f"node{i}" / "events.jsonl"), f"node{i}", str(i)])
            for i in range(2)
        ]

    def rank_pid(self, rank): return self.procs[rank].pid
    def node_pid(self, node): return self.procs[node].pid
    def node_shm(self, node): return []
    def node_alive(self, node): return self.procs[node].poll() is None
    def stop_node(self, node): self.procs[node].terminate()
    def start_node(self, node): raise NotImplementedError

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def job(tmp_path):
    j = FakeJob(tmp_path / "run")
    yield j
    j.close()


SCENARIO = {
    "name": "driver-test",
    "topology": {"nodes": 2, "workers_per_node": 1},
    "training": {"overrides": ["train.steps=1000"]},
    "properties": {"final_state": "skip", "no_leaks": False, "recovery_bound_seconds": 5},
    "faults": [
        {"kind": "hang", "target": "rank:1", "at_step": 4, "params": {"seconds": 0.4}},
        {"kind": "kill-worker", "target": "rank:0", "at_step": 10},
        {"kind": "disk-full", "target": "durable", "at_seconds": 0.2},
        {"kind": "kill-worker", "target": "rank:0", "at_step": 12},  # already dead: must fail, not pass
    ],
}


def wait_for(cond, timeout=timedelta(seconds=20)):
    deadline = time.monotonic() + timeout.total_seconds()
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_driver_fires_by_step_and_time_and_records_everything(job):
    sc = scenario_from_dict(SCENARIO)
    driver = FaultDriver(sc.plan(), job, poll=timedelta(milliseconds=50)).start()
    try:
        wait_for(lambda: job.procs[0].poll() is not None)  # killed at step ≥ 10
        wait_for(lambda: not driver.pending and not driver.active)
    finally:
        records = driver.stop()
    assert job.procs[0].returncode == -signal.SIGKILL
    by_id = {r.fault_id: r for r in records}
    assert by_id["f0"].status == "cleared" and by_id["f0"].pids == [job.procs[1].pid]
    assert psutil.Process(job.procs[1].pid).status() != psutil.STATUS_STOPPED  # resumed after 0.4 s
    assert by_id["f1"].status == "cleared"
    assert by_id["f2"].status == "skipped" and "small volume" in by_id["f2"].detail
    assert by_id["f3"].status == "failed" and "does not exist" in by_id["f3"].detail

    events = [json.loads(l) for l in (job.run_dir / "chaos" / "events.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e["fault_id"], e["status"]) for e in events]
    assert ("fault_injected", "f1", "injected") in kinds and ("fault_cleared", "f0", "cleared") in kinds
    # The kill fired at or after step 10 of the victim's own log.
    killed_at = next(e["time"] for e in events if e["fault_id"] == "f1")
    steps = [json.loads(l) for l in (job.run_dir / "node0" / "events.jsonl").read_text().splitlines() if '"step"' in l]
    assert max(e["step"] for e in steps if e["time"] <= killed_at) >= 10

    job.close()
    props = evaluate(sc, job.run_dir, records)
    names = {p.name: p for p in props}
    # Nobody restored after the kill: the campaign must fail, and say why.
    assert not names["recovery_within_bounds"].ok and "never restored" in names["recovery_within_bounds"].detail
    assert not names["training_completed"].ok
    assert report(job.run_dir) == 1
    md = (job.run_dir / "report.md").read_text()
    assert "**FAILED**" in md and "**SKIPPED**" in md and (job.run_dir / "timeline.png").exists()


def test_every_kind_builds_an_injector_or_a_reasoned_skip(job):
    from resilient_chaos.scenario import FAULT_KINDS, PARAMS_BY_KIND, PlannedFault, Target
    targets = {"link-cut": Target("link", 0, 1), "etcd-loss": Target("etcd", 0), "delay": Target("etcd"), "bandwidth": Target("etcd"),
               "reset": Target("etcd"), "storage-flaky": Target("durable"), "disk-full": Target("durable"),
               "first-agent-lost": Target("etcd")}
    for kind in FAULT_KINDS:
        params = PARAMS_BY_KIND[kind]()
        f = PlannedFault("x", kind, targets.get(kind, Target("rank" if kind in ("kill-worker", "bitflip") else "node", 0)), params, 1, None, timedelta(seconds=1))
        inj = make_injector(f, job)
        assert inj.kind == kind
        if type(inj).__name__ == "Unavailable":
            assert inj.preflight()


def test_infra_sets_up_and_leaves_nothing(tmp_path):
    import os
    import socketserver
    import threading

    from resilient_chaos.infra import Infra
    from resilient_chaos.properties import no_leaks

    sc = scenario_from_dict({
        "name": "infra", "topology": {"nodes": 2, "network": "netns", "proxy": ["etcd"]},
        "faults": [{"kind": "disk-full", "target": "durable", "at_step": 3},
                   {"kind": "partition", "target": "node:1", "at_step": 5}],
    })
    server = socketserver.TCPServer(("127.0.0.1", 0), socketserver.BaseRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    run = tmp_path / "run"
    try:
        with Infra(sc, run, volume_bytes=4 << 20) as infra:
            proxy = infra.proxy("etcd", server.server_address)
            for what, reason in infra.unavailable.items():
                print(f"skipped {what}: {reason}")
            if infra.volume is not None:
                assert os.path.ismount(infra.durable_path)
                assert f"snapshot.durable_url=file://{infra.durable_path}" in infra.launch_overrides()
            if infra.netlab is not None:
                assert len(infra.netlab.namespaces) == 2
            during = no_leaks(run, **infra.leak_kwargs())
            assert not during.ok and f"port {proxy.address[1]}" in during.detail  # the check sees live infra
            kwargs = infra.leak_kwargs()
        assert no_leaks(run, **kwargs).ok
    finally:
        server.shutdown()
        server.server_close()


def test_bitflip_request_is_a_valid_flipspec(job):
    """The params a bitflip request carries are exactly what the SDC hook's
    FlipSpec accepts (the consumer adds the step)."""
    inject = pytest.importorskip("resilient.sdc.inject")
    sc = scenario_from_dict({"name": "b", "topology": {"nodes": 2, "workers_per_node": 1},
                             "faults": [{"kind": "bitflip", "target": "rank:1", "at_step": 3,
                                         "params": {"target": "param", "tensor": "w", "bit": 29, "persistent": True}}]})
    inj = make_injector(sc.plan()[0], job)
    spec = inject.FlipSpec.from_dict({**inj.params, "step": 4})
    assert (spec.target, spec.tensor, spec.bit, spec.rank, spec.persistent) == ("param", "w", 29, 1, True)


class HealingJob(FakeJob):
    """A FakeJob whose lost 'nodes' come back (``heal``), with a round of
    both nodes logged, as the paced driver expects of a LocalJob."""

    def __init__(self, run_dir: Path):
        from resilient.events import EventLog
        self.log = EventLog(run_dir / "agents" / "events.jsonl", node="n0", rank=-1)
        self.log.emit("rendezvous", round=1, group_rank=0, nodes=["n0", "n1"])  # before the trainers' run_start
        super().__init__(run_dir)
        self.healed: list[tuple[float, int]] = []

    def heal(self, keep_down=frozenset()):
        out = []
        for i, p in enumerate(self.procs):
            if p.poll() is not None and i not in keep_down:
                self.healed.append((time.time(), i))
                self.log.emit("rendezvous", round=2 + len(self.healed), group_rank=0, nodes=["n0", "n1"])
                self.procs[i] = subprocess.Popen([sys.executable, "-c", TRAINER, str(self.run_dir / f"node{i}" / "events.jsonl"), f"node{i}", str(i)])
                out.append(f"n{i}")
        return out


def drive_paced(tmp_path, fault: dict, steps: int):
    """Kill-worker faults ``fault`` paced at ``steps`` on a HealingJob: (driver, records, job,
    every step event of both nodes)."""
    from resilient_chaos.campaign import Pace
    job = HealingJob(tmp_path / "run")
    plan = scenario_from_dict({**SCENARIO, "faults": [{"kind": "kill-worker", "target": "rank:random", "paced": True, **fault}]}).plan()
    assert all(f.paced for f in plan)
    driver = FaultDriver(plan, job, poll=timedelta(milliseconds=50), pace=Pace(seats=2, steps=steps, timeout=timedelta(seconds=30))).start()
    try:
        wait_for(lambda: len(driver.records) == len(plan) and driver._last is None, timeout=timedelta(seconds=60))
    finally:
        records = driver.stop()
        job.close()
    events = [json.loads(l) for i in range(2) for l in (job.run_dir / f"node{i}" / "events.jsonl").read_text().splitlines()]
    return driver, records, job, [e for e in events if e["event"] == "step"]


def test_paced_faults_fire_one_at_a_time_once_the_job_recovered(tmp_path):
    driver, records, job, steps = drive_paced(tmp_path, {"count": 3}, 5)
    assert [r.fault_id for r in records] == ["f0.0", "f0.1", "f0.2"]
    assert [r.status for r in records] == ["cleared"] * 3
    # Each kill waited for the replacement of the previous victim, then for 5 new steps.
    for prev, nxt in zip(records, records[1:]):
        healed_at = min(t for t, _ in job.healed if t >= prev.injected_at)
        assert healed_at < nxt.injected_at
        assert len({e["step"] for e in steps if healed_at < e["time"] < nxt.injected_at}) >= 5
    assert [p["fault_id"] for p in driver.pacing] == ["f0.0", "f0.1", "f0.2"]
    assert all(p["ready_seconds"] > 0 and p["replaced"] for p in driver.pacing)


def test_a_paced_fault_with_its_own_pace_waits_for_its_steps_and_the_previous_recovery_is_timed_apart(tmp_path):
    """A fault's own ``pace_steps`` (a fail-slow fault wants the detector's warm-up behind it)
    holds it back for that many steps at full strength; the previous fault's recovery is
    still timed at the scenario's pace."""
    driver, records, job, steps = drive_paced(tmp_path, {"count": 2, "pace_steps": 12}, 2)
    assert len(records) == 2
    healed_at = min(t for t, _ in job.healed if t >= records[0].injected_at)
    assert len({e["step"] for e in steps if healed_at < e["time"] < records[1].injected_at}) >= 12
    ready = records[0].injected_at + driver.pacing[0]["ready_seconds"]
    assert ready < records[1].injected_at - 0.2   # timed at 2 steps, fired after 12
    with pytest.raises(ConfigError, match="pace_steps"):
        scenario_from_dict({**SCENARIO, "faults": [{"kind": "kill-worker", "target": "rank:1", "at_step": 3, "pace_steps": 4}]})
