"""One timeline from every process's event log, and the fault episodes in it.

Each agent, worker and the harness itself append to their own
``events.jsonl``; :func:`load_timeline` merges all of them under a run
directory into one time-ordered list. :func:`episodes` then reads, for every
``fault_injected`` event, what happened next: when the runtime detected it,
when it restored (from which tier, which step), when training made progress
again, and how many steps of work were lost. Properties and the report are
computed from these, never from the runner's memory, so a recorded run
directory can be judged again later.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from resilient.events import EventTail, merge_events  # noqa: F401 - EventTail: the harness imports it from here

# Events by which the runtime shows it noticed a fault.
DETECTION_EVENTS = frozenset({
    "failure", "heartbeat_timeout", "preemption", "membership", "scale",
    "sdc_suspect", "worker_error", "upload_error", "restore_fallback", "rollback",
})


def event_logs(run_dir: str | os.PathLike) -> list[Path]:
    """Every ``events.jsonl`` under ``run_dir`` (one per node or process)."""
    return sorted(Path(run_dir).rglob("events.jsonl"))


def load_timeline(run_dirs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict]:
    """Merge every event log under one or several directories (or files)."""
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    paths: list[str] = []
    for d in run_dirs:
        p = Path(d)
        paths.extend(str(x) for x in ([p] if p.is_file() else event_logs(p)))
    return merge_events(paths)


def of_kind(timeline: list[dict], *kinds: str) -> list[dict]:
    return [e for e in timeline if e.get("event") in kinds]


def tier_of(e: dict) -> str:
    """A commit's (or restore's) tier. docs/events.md requires ``tier``; one without it
    that names a ``url`` is a durable one (tolerated, and worth fixing at the
    writer), anything else is 'unknown' and binds no restore."""
    return str(e.get("tier") or ("durable" if "url" in e else "unknown"))


def commits(timeline: list[dict]) -> list[dict]:
    return of_kind(timeline, "commit")


def faults(timeline: list[dict]) -> list[dict]:
    """``fault_injected`` events written by the harness (not acknowledgements
    of control requests, which carry ``request``, to avoid double counting)."""
    return [e for e in of_kind(timeline, "fault_injected") if "request" not in e]


NOT_INJECTED = frozenset({"skipped", "failed"})


@dataclass
class Episode:
    """What followed one injected fault. Times are UNIX seconds; None = never."""

    fault_id: str
    kind: str
    target: str
    status: str
    injected_at: float
    detected_at: float | None
    restored_at: float | None
    recovered_at: float | None
    step_before: int | None   # newest step reached before the fault
    restore_step: int | None  # step of the version restored
    tier: str | None
    detail: str = ""

    @property
    def recovery_seconds(self) -> float | None:
        if self.recovered_at is None:
            return None
        return self.recovered_at - self.injected_at

    @property
    def steps_lost(self) -> int | None:
        """Steps computed before the fault that had to be computed again."""
        if self.step_before is None or self.restore_step is None:
            return None
        return max(0, self.step_before - self.restore_step)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recovery_seconds"] = self.recovery_seconds
        d["steps_lost"] = self.steps_lost
        return d


def _first(timeline: list[dict], after: float, kinds: Iterable[str], until: float = float("inf")) -> dict | None:
    kinds = set(kinds)
    for e in timeline:
        t = e.get("time", 0.0)
        if after <= t < until and e.get("event") in kinds:
            return e
    return None


def episodes(timeline: list[dict]) -> list[Episode]:
    """One :class:`Episode` per injected fault, in injection order.

    A restore is attributed to a fault when it comes after the fault and
    before the next fault; the recovery ends at the first ``step`` event
    after that restore. Overlapping faults share what follows them.
    """
    fs = faults(timeline)
    real = [float(f.get("injected_at") or f["time"]) for f in fs if f.get("status") not in NOT_INJECTED]
    out = []
    for i, f in enumerate(fs):
        # When the injector acted, not when it logged (a kill logs after
        # the processes are confirmed gone).
        t0 = float(f.get("injected_at") or f["time"])
        nxt = min((t for t in real if t > t0), default=float("inf"))
        steps_before = [e["step"] for e in timeline if e.get("event") == "step" and e["time"] <= t0 and "step" in e]
        injected = f.get("status") not in NOT_INJECTED
        det = _first(timeline, t0, DETECTION_EVENTS, until=nxt) if injected else None
        res = _first(timeline, t0, ("restore", "rollback"), until=nxt) if injected else None
        rec = _first(timeline, res["time"], ("step",)) if res else None
        if res is not None and rec is not None and rec["time"] <= res["time"]:
            rec = None
        out.append(Episode(
            fault_id=str(f.get("fault_id", f"#{i}")),
            kind=str(f.get("fault", f.get("kind", "?"))),
            target=str(f.get("target", "")),
            status=str(f.get("status", "injected")),
            injected_at=t0,
            detected_at=det["time"] if det else None,
            restored_at=res["time"] if res else None,
            recovered_at=rec["time"] if rec else None,
            step_before=max(steps_before) if steps_before else None,
            restore_step=res.get("step") if res else None,
            tier=tier_of(res) if res else None,
            detail=str(f.get("detail", "")),
        ))
    return out
