"""Goodput: where a run's wall time went, read from its merged event log.

Fleet operators judge a job by its *effective training time ratio*: the share
of wall time spent on training steps whose results were kept. This module
splits a run's wall time into disjoint parts, from the events every process
already writes (``RUN_DIR/events.jsonl``, docs/events.md), so any recorded
run — a demo, a chaos campaign, a live job — can be judged the same way.

The arithmetic, exactly:

1. **Wall time** is ``[T0, T1]``: the first and the last event (``end=``
   overrides T1, e.g. "now" for a live job).
2. **Step completions.** ``step`` events are read in time order. Every rank
   reports each step; a report of a step number not above the newest one
   already counted, with no *restart marker* since, is another rank's report
   of the same step and is dropped. Restart markers are ``run_start``,
   ``restore`` and ``rollback``: after one, step numbers may go back.
   A completion's interval is ``(previous completion, this one]`` within a
   segment (between restart markers); the first completion of a segment
   covers only its own compute, ``[t - seconds, t]`` (the event's
   ``seconds``, clamped so intervals never overlap). Consecutive completions
   of one segment therefore tile time without gaps.
3. **Kept or redone.** A *setback* is a restart marker with the step the job
   goes back to: ``restore.step``, ``rollback.to_step``,
   ``run_start.start_step``. A completion of step ``s`` ending at ``t`` is
   *redone* (its work was lost) when any setback after ``t`` goes back to a
   step below ``s``; otherwise it is *kept*. A run that ends without redoing
   discarded steps still lost them.
4. **Snapshot stalls.** Each ``snapshot`` event's ``blocked_s`` is charged to
   the completion interval that holds the event; per interval, the ranks'
   sums are taken at their maximum (ranks block side by side, not one after
   the other), capped at the interval's length. The rest of a kept interval is
   *productive*, of a redone one *redone*. (The memory tiers' per-step copy
   writes no event: it stays inside productive time.)
5. **Gaps** are the time outside completion intervals:
   - before the first completion: *startup* (agent start → first step);
   - between two segments: from the gap's start (the last completion before
     it) to the first *detection* event in it (``failure``,
     ``heartbeat_timeout``, ``preemption``, ``worker_error``, ``sdc_suspect``,
     ``rollback``, ``evicted``, ``membership``, ``scale``) is *detection* (the
     step in flight when the fault struck plus the time to notice); from there
     to the first step's start is *recovery*. A ``preemption`` since the
     previous gap counts as this gap's detection at its start (training goes
     on through the grace period). A gap with no detection event (a planned
     change of membership) is recovery throughout;
   - after the last completion: detection and recovery as above when a
     detection event or a restart marker lies in it (a recovery the run did
     not finish), else *other* (the final save and shutdown, or the step
     still running);
   - a gap with no detection event in which every agent stopped cleanly
     (``agent_stop`` of every ``agent_start``ed node; an agent killed with
     -9 writes none, so a stop whose reason is ``finished`` counts for every
     node): the job ended and was launched again later (a resume). Up to the
     next ``agent_start`` it is *other*, from there to the first step
     *startup*. With a detection event (a preemption ends every rank) the
     whole gap is the incident's, relaunch included.
6. ``productive + redone + snapshot_stall + startup + detection + recovery +
   other == T1 - T0``, every part ≥ 0; **ratio** = productive / wall.
7. **Per cause.** Each inter-segment gap (and a tail gap that is not a
   clean end) is an *incident*, charged to one cause: in a chaos run, the
   newest ``fault_injected`` (injected, not skipped or failed) at or before
   the gap's detection point, by its kind (``kill-worker``, …): a restart
   with no fault of its own, such as a replaced node rejoining, is the tail
   of the fault before it (paced faults fire only once the job is back at
   full strength). Without chaos events, the first ``failure`` event's kind
   in the gap (``exit``, ``hang``, ``node_lost``, …), otherwise the first
   detection event's kind (``preemption``, ``sdc_suspect``, …), otherwise
   ``relaunch`` when an agent started in the gap (the job was killed and
   launched again), else ``restart``. A redone completion is charged to the
   incident whose gap holds the setback that discarded it. Faults that
   caused no restart (a slow link) are listed with their count and no cost:
   their slower steps count as productive time here.

Pure Python and no torch: ``resilient status`` and the chaos report call it.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Iterable

PARTS = ("productive", "redone", "snapshot_stall", "startup", "detection", "recovery", "other")

# Events after which step numbers may go back (a worker started, a version was loaded).
RESTART = frozenset({"run_start", "restore", "rollback"})
# The field of each restart marker that names the step the job goes back to.
SETBACK_FIELD = {"run_start": "start_step", "restore": "step", "rollback": "to_step"}
# Events by which the runtime shows it noticed something wrong.
DETECTION = frozenset({"failure", "heartbeat_timeout", "preemption", "worker_error", "sdc_suspect", "rollback",
                       "evicted", "membership", "scale"})
NOT_INJECTED = frozenset({"skipped", "failed"})


@dataclass
class Completion:
    """One step as the job completed it (every rank's reports merged)."""

    step: int
    start: float
    end: float
    kept: bool = True
    stall: float = 0.0
    incident: int | None = None  # for a redone step: the incident that discarded it

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(kw_only=True)
class Cost:
    """What training lost to something: detection, recovery and redone work (seconds)."""

    detection_s: float = 0.0
    recovery_s: float = 0.0
    redone_s: float = 0.0
    redone_steps: int = 0

    @property
    def cost_s(self) -> float:
        return self.detection_s + self.recovery_s + self.redone_s

    def add(self, other: "Cost") -> None:
        self.detection_s += other.detection_s
        self.recovery_s += other.recovery_s
        self.redone_s += other.redone_s
        self.redone_steps += other.redone_steps


@dataclass
class Incident(Cost):
    """A stretch without training between two segments (or at the end), and what it cost."""

    cause: str
    start: float                 # the last completion before it
    detected_at: float | None    # the first detection event in it
    end: float                   # the first step's start after it (or the end of the log)
    finished: bool               # training made a step again


@dataclass
class CauseCost(Cost):
    """What one cause (a chaos fault kind or a failure kind) cost in all."""

    injected: int = 0       # chaos faults of this kind injected (0 for failure kinds)
    incidents: int = 0


@dataclass
class Goodput:
    """Wall time split into the disjoint :data:`PARTS` (seconds), and what each cause cost."""

    start: float
    end: float
    productive: float = 0.0
    redone: float = 0.0
    snapshot_stall: float = 0.0
    startup: float = 0.0
    detection: float = 0.0
    recovery: float = 0.0
    other: float = 0.0
    steps_kept: int = 0
    steps_redone: int = 0
    stalls: int = 0          # steps with a snapshot stall charged
    incidents: list[Incident] = field(default_factory=list)
    by_cause: dict[str, CauseCost] = field(default_factory=dict)
    # (start, end, part) in time order, neighbours of one part merged: for a timeline band.
    spans: list[tuple[float, float, str]] = field(default_factory=list, repr=False)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def ratio(self) -> float | None:
        """The effective training time ratio: kept step time / wall time (None for an empty log)."""
        return self.productive / self.wall if self.wall > 0 else None

    def parts(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in PARTS}

    def to_dict(self) -> dict:
        r = lambda x: round(x, 6)  # noqa: E731  (microseconds: the log's own resolution)
        return {
            "wall_s": r(self.wall), "ratio": None if self.ratio is None else round(self.ratio, 6),
            "parts_s": {p: r(v) for p, v in self.parts().items()},
            "steps_kept": self.steps_kept, "steps_redone": self.steps_redone, "stalls": self.stalls,
            "by_cause": {k: {**{f: (r(v) if isinstance(v, float) else v) for f, v in asdict(c).items()},
                             "cost_s": r(c.cost_s)} for k, c in sorted(self.by_cause.items())},
            "incidents": [{**{f: (r(v) if isinstance(v, float) else v) for f, v in asdict(i).items()},
                           "cost_s": r(i.cost_s)} for i in self.incidents],
            "start": self.start, "end": self.end,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        """One line: the ratio and the parts as shares of the wall time."""
        if not self.wall > 0:
            return "goodput: no time recorded yet"
        shares = ", ".join(f"{p.replace('_', ' ')} {100 * v / self.wall:.1f}%" for p, v in self.parts().items() if v > 0)
        return f"goodput {100 * (self.ratio or 0):.1f}% of {self.wall:.0f} s ({shares})"


# ---------------------------------------------------------------- the steps
def _number(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _step_of(e: dict, key: str) -> int | None:
    v = e.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def completions(events: list[dict], t0: float) -> list[Completion]:
    """The job's step completions (rule 2 of the module docstring), in time order."""
    out: list[Completion] = []
    restarted, top = True, None
    for e in events:
        kind = e.get("event")
        if kind in RESTART:
            restarted = True
            continue
        s, t = _step_of(e, "step"), _number(e.get("time"))
        if kind != "step" or s is None or t is None:
            continue
        if not restarted and top is not None and s <= top:
            continue  # another rank's report of a step already counted
        floor = out[-1].end if out else t0
        if restarted or not out:
            begin = max(t - max(_number(e.get("seconds")) or 0.0, 0.0), floor)
        else:
            begin = floor
        out.append(Completion(s, min(begin, t), t))
        restarted, top = False, s
    return out


def _setbacks(events: list[dict]) -> list[tuple[float, int]]:
    out = []
    for e in events:
        kind = e.get("event")
        if kind in SETBACK_FIELD:
            r, t = _step_of(e, SETBACK_FIELD[kind]), _number(e.get("time"))
            if r is not None and t is not None:
                out.append((t, r))
    return out


def _mark_redone(done: list[Completion], setbacks: list[tuple[float, int]]) -> dict[int, float]:
    """Rule 3; returns completion index → the time of the setback that discarded it."""
    times = [t for t, _ in setbacks]
    suffix_min = [math.inf] * (len(setbacks) + 1)
    for i in range(len(setbacks) - 1, -1, -1):
        suffix_min[i] = min(setbacks[i][1], suffix_min[i + 1])
    by = {}
    for i, c in enumerate(done):
        j = bisect.bisect_right(times, c.end)
        if suffix_min[j] >= c.step:
            continue
        while setbacks[j][1] >= c.step:
            j += 1
        c.kept = False
        by[i] = setbacks[j][0]
    return by


def _charge_stalls(done: list[Completion], events: list[dict]) -> None:
    """Rule 4."""
    ends = [c.end for c in done]
    per: dict[int, dict] = {}
    for e in events:
        if e.get("event") != "snapshot":
            continue
        t, blocked = _number(e.get("time")), _number(e.get("blocked_s"))
        if t is None or not blocked or blocked < 0:
            continue
        i = bisect.bisect_left(ends, t)
        if i < len(done) and done[i].start < t:
            ranks = per.setdefault(i, {})
            key = (e.get("node"), e.get("rank"))
            ranks[key] = ranks.get(key, 0.0) + blocked
    for i, ranks in per.items():
        done[i].stall = min(max(ranks.values()), done[i].seconds)


# ---------------------------------------------------------------- the gaps
def _first_detection(events: list[dict], times: list[float], a: float, b: float) -> dict | None:
    for k in range(bisect.bisect_right(times, a), bisect.bisect_right(times, b)):
        if events[k].get("event") in DETECTION:
            return events[k]
    return None


def _preempted(events: list[dict], times: list[float], a: float, b: float) -> dict | None:
    """The newest ``preemption`` in ``(a, b]``: training goes on through its grace period, so it
    comes before the gap it causes."""
    for k in range(bisect.bisect_right(times, b) - 1, bisect.bisect_right(times, a) - 1, -1):
        if events[k].get("event") == "preemption":
            return events[k]
    return None


def _faults(events: list[dict]) -> list[tuple[float, str]]:
    """(injected_at, kind) of every chaos fault really injected (not the control acknowledgements)."""
    out = []
    for e in events:
        if e.get("event") != "fault_injected" or "request" in e or e.get("status") in NOT_INJECTED:
            continue
        t = _number(e.get("injected_at")) or _number(e.get("time"))
        if t is not None:
            out.append((t, str(e.get("fault", e.get("kind", "?")))))
    out.sort()
    return out


def _cause(events: list[dict], times: list[float], faults: list[tuple[float, str]],
           a: float, b: float, detected: dict | None) -> str:
    """Rule 7: who to charge a gap ``(a, b]`` to."""
    upto = max(detected["time"], a) if detected is not None else b
    chaos = [kind for t, kind in faults if t <= upto]
    if chaos:
        return chaos[-1]
    for k in range(bisect.bisect_right(times, a), bisect.bisect_right(times, b)):
        if events[k].get("event") == "failure":
            return str(events[k].get("kind", "failure"))
    if detected is not None:
        return str(detected["event"])
    starts = any(events[k].get("event") == "agent_start"
                 for k in range(bisect.bisect_right(times, a), bisect.bisect_right(times, b)))
    return "relaunch" if starts else "restart"


def _live_changes(events: list[dict]) -> list[tuple[float, int]]:
    """(time, number of live agents after it) at every ``agent_start`` / ``agent_stop``. An
    agent killed with -9 writes no stop: it stays counted until a stop that says training
    ``finished`` (the whole job is over), so only a clean end reads as "the job was not running"."""
    live: set = set()
    out = []
    for e in events:
        kind = e.get("event")
        if kind in ("agent_start", "agent_stop"):
            if kind == "agent_start":
                live.add(e.get("node"))
            elif e.get("reason") == "finished":
                live.clear()  # training completed: the job is over, agents killed earlier included
            else:
                live.discard(e.get("node"))
            out.append((float(e["time"]), len(live)))
    return out


def _idle(live: list[tuple[float, int]], a: float, b: float) -> tuple[float, float] | None:
    """``(z, w)`` inside ``(a, b]``: no agent was live from ``z`` until one started at ``w``
    (``w = b`` when none did)."""
    times = [t for t, _ in live]
    for k in range(bisect.bisect_right(times, a), bisect.bisect_right(times, b)):
        if live[k][1] == 0:
            z = live[k][0]
            w = next((t for t, n in live[k + 1:] if n > 0 and t <= b), b)
            return z, w
    return None


def goodput(events: Iterable[dict], end: float | None = None) -> Goodput:
    """Split the wall time of a merged event log (:func:`resilient.events.merge_events`)."""
    evs = sorted((e for e in events if _number(e.get("time")) is not None), key=lambda e: float(e["time"]))
    if not evs:
        now = end or 0.0
        return Goodput(start=now, end=now)
    times = [float(e["time"]) for e in evs]
    t0, t1 = times[0], max(times[-1], end if end is not None else times[-1])
    g = Goodput(start=t0, end=t1)
    done = completions(evs, t0)
    discarded_by = _mark_redone(done, _setbacks(evs))
    _charge_stalls(done, evs)
    faults = _faults(evs)
    for kind in (k for _, k in faults):
        g.by_cause.setdefault(kind, CauseCost()).injected += 1
    spans = g.spans
    if not done:
        g.startup = t1 - t0
        g.spans = _merged([(t0, t1, "startup")])
        return g
    for c in done:
        g.snapshot_stall += c.stall
        g.stalls += c.stall > 0
        spans += [(c.start, min(c.start + c.stall, c.end), "snapshot_stall")] if c.stall else []
        spans.append((min(c.start + c.stall, c.end), c.end, "productive" if c.kept else "redone"))
        if c.kept:
            g.productive += c.seconds - c.stall
            g.steps_kept += 1
        else:
            g.redone += c.seconds - c.stall
            g.steps_redone += 1
    g.startup = done[0].start - t0
    spans.append((t0, done[0].start, "startup"))
    # The gaps: between segments (where one completion's end is not the next one's start), then the tail.
    gaps = [(done[i - 1].end, done[i].start, i) for i in range(1, len(done)) if done[i].start > done[i - 1].end
            or (done[i].start == done[i - 1].end and _restart_between(evs, times, done[i - 1].end, done[i].end))]
    gaps.append((done[-1].end, t1, len(done)))
    gap_of: dict[int, int] = {}  # completion index after a gap → incident index
    after = t0
    live = _live_changes(evs)
    for a, b, nxt in gaps:
        tail = nxt == len(done)
        det = _first_detection(evs, times, a, b) or _preempted(evs, times, after, a)  # after: the previous gap's end
        idle = _idle(live, a, b) if det is None else None
        if idle is not None:  # the job ended cleanly (every agent), then was launched again (or not)
            g.other += idle[1] - a
            g.startup += b - idle[1]
            spans += [(a, idle[1], "other"), (idle[1], b, "startup")]
            after = b
            continue
        if det is None and tail and not _restart_between(evs, times, a, b):
            g.other += b - a  # a clean end: the final save and shutdown
            spans.append((a, b, "other"))
            continue
        d = min(max(det["time"], a), b) if det is not None else a
        inc = Incident(cause=_cause(evs, times, faults, a, b, det), start=a,
                       detected_at=None if det is None else d, end=b,
                       finished=not tail, detection_s=d - a, recovery_s=b - d)
        g.detection += inc.detection_s
        g.recovery += inc.recovery_s
        spans += [(a, d, "detection"), (d, b, "recovery")]
        gap_of[nxt] = len(g.incidents)
        g.incidents.append(inc)
        after = b
    # Charge each redone completion to the incident holding the setback that discarded it.
    ends = [c.end for c in done]
    for i, t in discarded_by.items():
        # A setback starts a segment: the gap before the first completion after it holds it.
        k = gap_of.get(bisect.bisect_left(ends, t))
        if k is None:
            continue
        inc = g.incidents[k]
        done[i].incident = k
        inc.redone_s += done[i].seconds - done[i].stall
        inc.redone_steps += 1
    for inc in g.incidents:
        c = g.by_cause.setdefault(inc.cause, CauseCost())
        c.incidents += 1
        c.add(inc)
    g.spans = _merged(spans)
    return g


def _merged(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    out: list[tuple[float, float, str]] = []
    for a, b, part in sorted(s for s in spans if s[1] > s[0]):
        if out and out[-1][2] == part and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(b, out[-1][1]), part)
        else:
            out.append((a, b, part))
    return out


def _restart_between(events: list[dict], times: list[float], a: float, b: float) -> bool:
    """Whether a restart marker lies in ``(a, b]`` (a segment whose first step was clamped to
    the previous one's end: a zero-length gap, still an incident)."""
    return any(events[k].get("event") in RESTART
               for k in range(bisect.bisect_right(times, a), bisect.bisect_right(times, b)))
