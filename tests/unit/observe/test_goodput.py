"""Goodput arithmetic (resilient/observe/goodput.py) on timelines with known faults.

Times are multiples of 1/8 s, so every part is exact in floating point and the
expected split is compared with ``==``."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.observe.goodput import PARTS, goodput


def ev(t: float, event: str, rank: int = -1, node: str = "n0", **fields) -> dict:
    return {"time": t, "event": event, "node": node, "rank": rank, **fields}


def steps(t: float, step: int, seconds: float = 0.5) -> list[dict]:
    """Both ranks report the step (rank 1 a little later, as a real log has it)."""
    return [ev(t, "step", 0, step=step, seconds=seconds, loss=1.0),
            ev(t + 1 / 64, "step", 1, step=step, seconds=seconds, loss=1.0)]


def restart(t: float, step: int) -> list[dict]:
    return [ev(t, r_event, r, **({"start_step": step} if r_event == "run_start" else {"step": step, "tier": "local"}))
            for r in (0, 1) for r_event in ("restore", "run_start")]


def recorded_timeline() -> list[dict]:
    """Two ranks; a slow-link fault that costs no restart; a worker killed (two steps redone);
    a hung worker, caught by its heartbeat; a clean finish."""
    out = [ev(0.0, "agent_start"), ev(1.0, "run_start", 0, start_step=0), ev(1.0, "run_start", 1, start_step=0)]
    out += steps(2.0, 1) + steps(2.5, 2) + steps(3.0, 3) + steps(3.5, 4)
    out += [ev(2.25, "snapshot", 0, step=2, blocked_s=0.125), ev(2.25, "snapshot", 1, step=2, blocked_s=0.0625),
            ev(2.3, "commit", step=2, tier="local"),
            ev(2.75, "fault_injected", fault="delay", status="injected", injected_at=2.75, target="etcd"),
            ev(3.75, "fault_injected", fault="kill-worker", status="injected", injected_at=3.75, target="rank:1"),
            ev(3.8, "fault_injected", fault="bitflip", status="skipped", target="rank:0"),
            ev(4.0, "failure", kind="exit", local_rank=1, exitcode=-9)]
    out += restart(5.0, 2) + steps(6.0, 3) + steps(6.5, 4) + steps(7.0, 5)
    out += [ev(7.25, "fault_injected", fault="hang", status="injected", injected_at=7.25, target="rank:0"),
            ev(8.0, "heartbeat_timeout", local_rank=0, seconds_since_beat=1.0), ev(8.0, "failure", kind="hang", local_rank=0)]
    out += restart(9.0, 5) + steps(10.0, 6) + steps(10.5, 7)
    out += [ev(11.0, "agent_stop", reason="finished")]
    return sorted(out, key=lambda e: e["time"])


def test_exact_split_of_a_timeline_with_known_faults():
    g = goodput(recorded_timeline())
    assert g.wall == 11.0
    # steps 1, 2 (less its 0.125 s snapshot stall: the slower rank's), 3-5 redone after the kill, 6, 7
    assert g.parts() == {"productive": 3.375, "redone": 1.0, "snapshot_stall": 0.125, "startup": 1.5,
                         "detection": 1.5, "recovery": 3.0, "other": 0.5}
    assert g.ratio == 3.375 / 11.0
    assert (g.steps_kept, g.steps_redone) == (7, 2)
    kill, hang = g.incidents
    assert (kill.cause, kill.start, kill.detected_at, kill.end) == ("kill-worker", 3.5, 4.0, 5.5)
    assert (kill.detection_s, kill.recovery_s, kill.redone_s, kill.redone_steps) == (0.5, 1.5, 1.0, 2)
    assert (hang.cause, hang.detection_s, hang.recovery_s, hang.redone_steps) == ("hang", 1.0, 1.5, 0)
    costs = g.to_dict()["by_cause"]
    assert costs["kill-worker"] == {"injected": 1, "incidents": 1, "detection_s": 0.5, "recovery_s": 1.5,
                                    "redone_s": 1.0, "redone_steps": 2, "cost_s": 3.0}
    assert costs["delay"]["injected"] == 1 and costs["delay"]["cost_s"] == 0.0  # slower, never stopped
    assert costs["hang"]["injected"] == 1 and costs["hang"]["cost_s"] == 2.5
    assert "bitflip" not in costs  # skipped: never injected
    assert json.loads(g.to_json())["parts_s"]["productive"] == 3.375
    assert g.spans[:4] == [(0.0, 1.5, "startup"), (1.5, 2.0, "productive"), (2.0, 2.125, "snapshot_stall"),
                           (2.125, 2.5, "productive")]


def test_chaos_report_shows_the_split(tmp_path):
    """`resilient chaos report` on the same timeline: the ratio, the parts, the cost per fault
    kind in report.md, and the band under the timeline plot."""
    from resilient_chaos.report import report

    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in recorded_timeline()))
    report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Effective training time ratio: **30.7%** of 11.0 s" in md
    assert "| productive (steps kept) | 3.38 | 30.7% |" in md and "| redone (steps computed again) | 1.00 | 9.1% |" in md
    assert "| kill-worker | 1 | 1 | 0.50 s | 1.50 s | 1.00 s | 2 | 3.00 s |" in md
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_a_job_finished_and_launched_again_is_not_an_incident():
    out = [ev(0.0, "agent_start"), ev(0.5, "run_start", 0, start_step=0)] + steps(1.0, 1) + steps(1.5, 2)
    out += [ev(2.0, "agent_stop", reason="finished"), ev(5.0, "agent_start"),
            ev(6.0, "restore", 0, step=2, tier="durable"), ev(6.0, "run_start", 0, start_step=2)]
    out += steps(7.0, 3) + [ev(7.5, "agent_stop", reason="finished")]
    g = goodput(out)
    assert g.incidents == []
    # startup: 0 → 0.5 and 5.0 → 6.5; other: the shutdowns (0.5 + 0.5) and the 3 s nobody ran
    assert g.parts() == {"productive": 1.5, "redone": 0.0, "snapshot_stall": 0.0, "startup": 2.0,
                         "detection": 0.0, "recovery": 0.0, "other": 4.0}


def test_a_setback_the_run_never_made_up_is_lost_work():
    """Preempted after step 4, restored to step 2 and ended there: steps 3 and 4 were lost."""
    out = [ev(0.0, "agent_start"), ev(0.5, "run_start", 0, start_step=0)]
    out += steps(1.0, 1) + steps(1.5, 2) + steps(2.0, 3) + steps(2.5, 4)
    out += [ev(3.0, "preemption", signal="SIGTERM", grace_seconds=3), ev(4.0, "restore", 0, step=2, tier="durable")]
    g = goodput(out)
    assert (g.steps_kept, g.steps_redone, g.redone) == (2, 2, 1.0)
    (pre,) = g.incidents
    assert (pre.cause, pre.finished, pre.detection_s, pre.recovery_s, pre.redone_steps) == ("preemption", False, 0.5, 1.0, 2)


def test_without_chaos_events_the_failure_kind_is_the_cause():
    out = [ev(0.0, "agent_start"), ev(0.5, "run_start", 0, start_step=0)] + steps(1.0, 1) + steps(1.5, 2)
    out += [ev(2.0, "failure", kind="exit", local_rank=0, exitcode=1), ev(3.0, "restore", 0, step=2)]
    out += steps(4.0, 3) + [ev(4.5, "failure", kind="node_lost", nodes=["n1"])]
    g = goodput(out)
    assert [(i.cause, i.finished, i.detection_s, i.recovery_s) for i in g.incidents] == [
        ("exit", True, 0.5, 1.5), ("node_lost", False, 0.5, 0.0)]
    assert g.by_cause["exit"].injected == 0 and g.by_cause["exit"].incidents == 1


# A random log: steps (possibly going back), restarts, snapshots, failures, faults, agents.
KINDS = st.sampled_from(["step", "step", "step", "restore", "run_start", "rollback", "snapshot", "failure",
                         "fault_injected", "agent_start", "agent_stop", "commit", "heartbeat_timeout"])


@st.composite
def timelines(draw) -> list[dict]:
    n = draw(st.integers(0, 60))
    t = draw(st.floats(0, 1e9, allow_nan=False))
    out = []
    for _ in range(n):
        t += draw(st.floats(0, 10, allow_nan=False))
        kind = draw(KINDS)
        s = draw(st.integers(0, 20))
        fields = {"step": {"step": s, "seconds": draw(st.floats(-1, 5, allow_nan=False))},
                  "restore": {"step": s}, "run_start": {"start_step": s}, "rollback": {"to_step": s},
                  "snapshot": {"step": s, "blocked_s": draw(st.floats(0, 3, allow_nan=False))},
                  "failure": {"kind": "exit"}, "agent_stop": {"reason": draw(st.sampled_from(["finished", "SIGTERM"]))},
                  "fault_injected": {"fault": "kill-worker", "status": draw(st.sampled_from(["injected", "skipped"]))},
                  }.get(kind, {})
        out.append(ev(t, kind, draw(st.integers(-1, 2)), node=draw(st.sampled_from(["a", "b"])), **fields))
    return out


@settings(max_examples=120, deadline=None)
@given(timelines())
def test_parts_sum_to_wall_time_and_none_is_negative(timeline):
    g = goodput(timeline)
    parts = g.parts()
    assert set(parts) == set(PARTS)
    assert all(v >= 0 for v in parts.values()), parts
    assert abs(sum(parts.values()) - g.wall) <= 1e-6 * max(1.0, abs(g.end)), (parts, g.wall)
    if g.ratio is not None:
        assert 0 <= g.ratio <= 1 + 1e-12
    for inc in g.incidents:
        assert inc.detection_s >= 0 and inc.recovery_s >= 0 and inc.redone_s >= 0
    assert sum(c.incidents for c in g.by_cause.values()) == len(g.incidents)
    assert sum(i.redone_steps for i in g.incidents) <= g.steps_redone
    spans = g.spans  # the band the chaos report draws: in order, disjoint, covering the wall time
    assert all(a < b for a, b, _ in spans) and all(s[1] <= t[0] for s, t in zip(spans, spans[1:]))
    assert abs(sum(b - a for a, b, _ in spans) - g.wall) <= 1e-6 * max(1.0, abs(g.end))
