"""Property checks and reports on recorded (synthetic) timelines: a correct
run passes, and each kind of violation really fails and is reported."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from resilient_chaos.injectors import InjectionRecord
from resilient_chaos.properties import (
    PropertyResult, check_timeline, commit_exactly_once, final_state_equal, no_committed_step_lost, no_leaks,
    recovery_within_bounds, training_completed,
)
from resilient_chaos.report import failed_record, report, write_results
from resilient_chaos.timeline import episodes, load_timeline

T0 = 1_700_000_000.0


class Run:
    """Writes events the way the runtime would: one log per node + the harness."""

    def __init__(self, root: Path):
        self.root = root

    def emit(self, t: float, event: str, node: str = "node0", rank: int = 0, **fields):
        path = self.root / node / "events.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"time": T0 + t, "event": event, "node": node, "rank": rank, **fields}) + "\n")

    def train(self, steps, t_of, ranks=((0, "node0"), (1, "node1")), local=True, durable_every=5, peer=False):
        for s in steps:
            for rank, node in ranks:
                self.emit(t_of(s), "step", node, rank, step=s, loss=1.0 / s)
            if local:
                self.emit(t_of(s) + 0.1, "commit", "node0", -1, tier="local", step=s)
            if peer:
                self.emit(t_of(s) + 0.2, "commit", "node0", -1, tier="peer", step=s)
            if durable_every and s % durable_every == 0:
                self.emit(t_of(s) + 0.3, "commit", "node0", -1, tier="durable", step=s)

    def fault(self, t: float, kind: str, fault_id: str = "f0", target: str = "rank:1", status: str = "injected"):
        self.emit(t, "fault_injected", "chaos", -1, fault=kind, fault_id=fault_id, target=target, status=status)

    def timeline(self):
        return load_timeline(self.root)


def good_run(root: Path, kind="kill-worker", restore_step=12, tier="local") -> Run:
    """Steps 1-12, a fault, restore, steps 13-20."""
    r = Run(root)
    for rank, node in ((0, "node0"), (1, "node1")):
        r.emit(0.0, "run_start", node, rank)
    r.train(range(1, 13), lambda s: float(s), peer=True)
    r.fault(12.5, kind)
    r.emit(13.0, "failure", "node0", -1, reason="worker exited -9")
    for rank, node in ((0, "node0"), (1, "node1")):
        r.emit(14.0, "run_start", node, rank)
        r.emit(15.0, "restore", node, rank, tier=tier, step=restore_step, seconds=0.8)
    r.train(range(restore_step + 1, 21), lambda s: 16.0 + s - restore_step, peer=True)
    for rank, node in ((0, "node0"), (1, "node1")):
        r.emit(30.0, "run_end", node, rank, step=20)
    return r


def verdicts(results):
    return {p.name: p.ok for p in results}


def test_good_run_passes_and_report_says_so(tmp_path):
    r = good_run(tmp_path)
    tl = r.timeline()
    eps = episodes(tl)
    assert len(eps) == 1
    ep = eps[0]
    assert ep.kind == "kill-worker" and ep.tier == "local" and ep.restore_step == 12 and ep.steps_lost == 0
    assert ep.detected_at == T0 + 13.0 and ep.recovery_seconds == pytest.approx(16.0 + 1 - 12.5)
    results = check_timeline(tl, eps, bound=timedelta(seconds=10), steps=20)
    assert all(p.ok for p in results), results
    # without the campaign's results.json (an interrupted campaign) it is never a pass
    assert report(tmp_path) == 1
    assert "| campaign_finished | **FAIL** |" in (tmp_path / "report.md").read_text()
    (tmp_path / "results.json").write_text(json.dumps({"scenario": {"name": "good"}, "injections": [],
                                                       "properties": [p.to_dict() for p in results]}))
    assert report(tmp_path) == 0
    md = (tmp_path / "report.md").read_text()
    assert "— PASS" in md and "| f0 | kill-worker |" in md and "| local |" in md
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_restore_older_than_a_surviving_commit_fails(tmp_path):
    # A deliberately broken restore: back to durable step 10 although local
    # RAM (which survives a worker kill) held step 12.
    tl = good_run(tmp_path, restore_step=10, tier="durable").timeline()
    res = no_committed_step_lost(tl)
    assert not res.ok and "restore to step 10" in res.detail and "step 12 was committed" in res.detail
    assert report(tmp_path) == 1
    md = (tmp_path / "report.md").read_text()
    assert "— FAIL" in md and "| no_committed_step_lost | **FAIL** |" in md


def test_node_loss_may_fall_back_to_the_peer_tier(tmp_path):
    # Local RAM dies with the node: restoring peer step 11 when local held 12
    # is legal only if peer's newest commit before the fault was 11.
    r = Run(tmp_path)
    r.train(range(1, 13), float, local=True, peer=False)
    for s in range(1, 12):
        r.emit(s + 0.2, "commit", "node0", -1, tier="peer", step=s)
    r.fault(12.5, "kill-node", target="node:1")
    r.emit(15.0, "restore", "node0", 0, tier="peer", step=11)
    r.train(range(12, 16), lambda s: 5.0 + s)  # recomputes step 12, commits it again at local
    tl = r.timeline()
    assert no_committed_step_lost(tl).ok
    assert commit_exactly_once(tl).ok  # re-commit after a restore to an earlier step
    assert not no_committed_step_lost(tl, {"kill-node": ["local", "peer", "durable"]}).ok
    eps = episodes(tl)
    assert eps[0].steps_lost == 1 and eps[0].tier == "peer"


def test_step_committed_twice_fails(tmp_path):
    r = good_run(tmp_path)
    r.emit(31.0, "commit", "node1", -1, tier="durable", step=20)  # a racing uploader
    res = commit_exactly_once(r.timeline())
    assert not res.ok and "step 20 committed twice at tier durable" in res.detail
    assert not commit_exactly_once(r.timeline(), expected={"durable": [25]}).ok


def test_restart_without_restore_fails(tmp_path):
    r = Run(tmp_path)
    r.emit(0.0, "run_start")
    r.train(range(1, 11), float, ranks=((0, "node0"),))
    r.fault(10.5, "kill-worker", target="rank:0")
    r.emit(12.0, "run_start")
    r.train(range(1, 4), lambda s: 12.0 + s, ranks=((0, "node0"),), local=False, durable_every=0)
    res = no_committed_step_lost(r.timeline())
    assert not res.ok and "without a restore" in res.detail


def test_recovery_bound_and_missing_recovery(tmp_path):
    tl = good_run(tmp_path).timeline()
    eps = episodes(tl)
    slow = recovery_within_bounds(eps, timedelta(seconds=2))
    assert not slow.ok and "> bound 2.0 s" in slow.detail
    assert recovery_within_bounds(eps, {"kill-worker": timedelta(seconds=5)}).ok

    r = Run(tmp_path / "never")
    r.train(range(1, 5), float)
    r.fault(4.5, "kill-node", target="node:1")
    res = recovery_within_bounds(episodes(r.timeline()), timedelta(seconds=60))
    assert not res.ok and "never restored" in res.detail
    assert not training_completed(r.timeline(), 20).ok


def test_skipped_faults_are_not_judged_but_reported(tmp_path):
    r = good_run(tmp_path)
    r.fault(20.0, "partition", fault_id="f1", target="node:1", status="skipped")
    tl = r.timeline()
    assert recovery_within_bounds(episodes(tl), timedelta(seconds=10)).ok
    skipped = InjectionRecord("partition", "node:1", "skipped", "f1", T0 + 20, detail="skipped: 'ip netns add' is not permitted")
    write_results(tmp_path, scenario={"name": "mixed"}, properties=check_timeline(tl, episodes(tl), bound=timedelta(seconds=10)), injections=[skipped])
    assert report(tmp_path) == 0
    md = (tmp_path / "report.md").read_text()
    assert "# Chaos report: mixed — PASS" in md and "**SKIPPED**" in md and "not permitted" in md


def test_results_json_verdicts_drive_the_exit_code(tmp_path):
    good_run(tmp_path)
    digest_ref, digest_run = "ab" * 16, "ac" * 16
    props = [PropertyResult("no_committed_step_lost", True, "ok"), final_state_equal(digest_ref, digest_run)]
    write_results(tmp_path, scenario="kill-worker", properties=props)
    assert report(tmp_path) == 1
    md = (tmp_path / "report.md").read_text()
    assert "| final_state_equal | **FAIL** | digests differ" in md
    write_results(tmp_path, scenario="kill-worker", properties=[PropertyResult("x", True)],
                  injections=[failed_record("hang", "rank:1", "f0", RuntimeError("pid 5 does not exist"))])
    assert report(tmp_path) == 1
    assert "**FAILED**" in (tmp_path / "report.md").read_text()
    write_results(tmp_path, scenario="kill-worker", properties=[])
    assert report(tmp_path) == 1  # nothing checked proves nothing


def test_final_state_digest_and_tolerance():
    assert final_state_equal("d1", "d1").ok
    assert not final_state_equal("d1", None).ok
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))
    assert final_state_equal([1.0, 2.0], [1.0, 2.0 + 1e-7], diff=diff, tolerance=1e-6).ok
    res = final_state_equal([1.0, 2.0], [1.0, 2.1], diff=diff, tolerance=1e-6)
    assert not res.ok and "> tolerance" in res.detail


def test_no_leaks_finds_processes_shm_and_ports(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "rsnap-job1-node0").write_bytes(b"x")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", str(run_dir)])
    try:
        res = no_leaks(run_dir, shm_prefix="rsnap-job1", ports=[port], shm_dir=str(shm))
        assert not res.ok
        assert f"process {p.pid}" in res.detail and "rsnap-job1-node0" in res.detail and f"port {port}" in res.detail
    finally:
        p.kill()
        p.wait(10)
        srv.close()
    (shm / "rsnap-job1-node0").unlink()
    assert no_leaks(run_dir, shm_prefix="rsnap-job1", ports=[port], shm_dir=str(shm)).ok


def test_a_paced_fault_the_job_never_recovered_from_fails_the_soak():
    from resilient_chaos.runner import _paced_recovered
    good = [{"fault_id": "f0.0", "kind": "kill-node", "ready_seconds": 12.5}, {"fault_id": "f1.0", "kind": "hang"}]
    assert _paced_recovered(good).ok and "cut short" in _paced_recovered(good).detail
    bad = good + [{"fault_id": "f2.0", "kind": "link-cut", "not_ready": "0:04:00 after it ended: 2 of 3 seats"}]
    res = _paced_recovered(bad)
    assert not res.ok and "f2.0 (link-cut)" in res.detail


def test_kind_summary_counts_and_times_per_kind():
    from resilient_chaos.injectors import InjectionRecord
    from resilient_chaos.report import kind_summary
    from resilient_chaos.timeline import Episode
    eps = [Episode("a", "kill-worker", "rank:0", "cleared", 10.0, 10.1, 11.0, 12.0, 7, 6, "local"),
           Episode("b", "kill-worker", "rank:1", "cleared", 20.0, 20.1, 21.0, 24.0, 9, 9, "peer")]
    recs = [InjectionRecord("kill-worker", "rank:0", "cleared", "a"), InjectionRecord("kill-worker", "rank:1", "cleared", "b"),
            InjectionRecord("partition", "node:1", "skipped", "c", detail="skipped: no netns")]
    pacing = [{"fault_id": "a", "kind": "kill-worker", "ready_seconds": 3.0}, {"fault_id": "b", "kind": "kill-worker", "ready_seconds": 5.0}]
    out = kind_summary(eps, recs, pacing)
    kw = out["kill-worker"]
    assert kw["injected"] == 2 and kw["restores"] == 2 and kw["steps_lost"] == {"total": 1, "max": 1}
    assert kw["recovery_seconds"]["max"] == 4.0 and kw["full_strength_seconds"]["mean"] == 4.0
    assert out["partition"]["skipped"] == 1 and "no netns" in out["partition"]["skip_reason"]
