"""``snapshot.every = "auto"``: snapshot intervals that fit the link and the failure rate.

A tier whose interval is ``"auto"`` (``snapshot.every`` for node RAM and its peers,
``snapshot.durable_every`` for the durable tier) takes a version every ``every`` steps, where
``every`` is chosen while the job runs:

- **Young/Daly.** A version costs the job ``C`` seconds (the step blocked by the capture, plus
  the memory tier's etcd commit, which runs on a host that trains); a failure loses on average
  half an interval of work. The interval that minimizes the sum is ``√(2·C·MTBF)`` seconds
  (Young 1974; Daly 2006), i.e. ``√(2·C·MTBF) / step_s`` steps.
- **MTBF** is what the job has seen, with a prior: ``(prior + T) / (1 + F)`` for ``F`` failures
  in ``T`` seconds of training over all incarnations (:func:`mtbf_s`). The prior
  (``snapshot.auto_mtbf_hours``) counts as one failure-free stretch, so a young job is not
  steered by one early failure, and a job that keeps failing converges to ``T / F``. Failures
  are what the job can observe: a restore at start-up (unless the version it restores was the
  previous incarnation's end-of-run or preemption save) and an SDC rollback.
- **Bandwidth budget.** A version moves ``B`` bytes over the tier's link (peer RAM: the node's
  pushes; durable: the upload) at the measured throughput ``L``; the tier may take at most
  ``snapshot.auto_budget`` of the link's time: ``every ≥ B / (L · budget · step_s)``.
- **Bounds** ``snapshot.auto_min_steps`` ≤ every ≤ ``snapshot.auto_max_steps``.

Every rank must capture at the same steps (a version is committed only when every rank wrote
it), so the inputs are agreed before the choice: each rank's measurements are reduced with
``MAX`` (the slowest rank's step, the costliest capture, the slowest link) in one small
all-reduce, and every rank evaluates the same pure function (:func:`choose`) on the same
numbers. A choice is made after the first version of a run or restart and after every
:data:`RETUNE` versions since; the next version of a tier is due ``every`` steps after its
previous one (not on multiples of ``every``: an interval that changes would otherwise leave
one short gap).

Each choice that changes a tier's interval is a ``snapshot_interval`` event with its inputs
(docs/events.md); the intervals, the failure count and the training time ride in each version's
global state (:data:`HISTORY_KEY`), so the next incarnation starts from them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from resilient.snapshot.config import AUTO, SnapshotConfig

TIERS = ("memory", "durable")
RETUNE = 4                              # captures between two choices (each is one all-reduce)
HISTORY_KEY = "snapshot_interval"       # in each version's global state


@dataclass(frozen=True)
class Limits:
    """The knobs of a choice (``[snapshot] auto_*``)."""

    prior_mtbf_s: float
    budget: float
    lo: int
    hi: int

    @classmethod
    def from_config(cls, cfg: SnapshotConfig) -> "Limits":
        return cls(cfg.auto_mtbf_hours * 3600.0, cfg.auto_budget, cfg.auto_min_steps, cfg.auto_max_steps)


@dataclass(frozen=True)
class Measured:
    """What a tier's versions cost and how often the job fails, agreed by every rank."""

    step_s: float            # seconds of a training step (the slowest rank's; 0 = not measured yet)
    cost_s: float            # seconds a version costs the job: the blocked capture (+ etcd commit)
    bytes: float = 0.0       # bytes of a version over the tier's link
    link_bytes_s: float = 0.0  # that link's measured throughput (0 = not measured yet: no budget floor)
    failures: int = 0
    seconds: float = 0.0     # training seconds observed, every incarnation together


@dataclass(frozen=True)
class Choice:
    every: int
    bound: str               # what set it: "young_daly", "budget", "min", "max" or "unmeasured"
    young_daly: float        # the Young/Daly interval in steps, before budget and bounds
    budget_floor: float      # the fewest steps apart that keep the tier within its link budget
    mtbf_s: float


def mtbf_s(prior_s: float, failures: int, seconds: float) -> float:
    """The mean time between failures: the prior as one failure-free stretch, plus what was seen."""
    return (prior_s + max(seconds, 0.0)) / (1 + max(failures, 0))


def choose(m: Measured, lim: Limits) -> Choice:
    """The interval in steps for one tier (pure: every rank computes it from agreed inputs)."""
    mtbf = mtbf_s(lim.prior_mtbf_s, m.failures, m.seconds)
    if m.step_s <= 0:
        return Choice(lim.lo, "unmeasured", 0.0, 0.0, mtbf)
    young_daly = math.sqrt(2.0 * max(m.cost_s, 0.0) * mtbf) / m.step_s
    transfer_s = m.bytes / m.link_bytes_s if m.link_bytes_s > 0 and m.bytes > 0 else 0.0
    floor = transfer_s / (lim.budget * m.step_s)
    # Young/Daly to the nearest step; the budget is a floor (at least this far apart): rounded
    # up. Each rounded alone, so the interval never falls when a cost or a byte count grows.
    # (Both capped just past the bound first: a link measured at almost nothing is no overflow.)
    cap = lim.hi + 1.0
    near, least = math.floor(min(young_daly, cap) + 0.5), math.ceil(min(floor, cap) - 1e-9)
    every, bound = (near, "young_daly") if near >= least else (least, "budget")
    if every < lim.lo:
        every, bound = lim.lo, "min"
    elif every > lim.hi:
        every, bound = lim.hi, "max"
    return Choice(int(every), bound, young_daly, floor, mtbf)


@dataclass(frozen=True)
class Intervals:
    """Each tier's interval now (a fixed knob's value, or the auto choice): for the progress
    line's staleness marks (:func:`resilient.job.job.committed_text`)."""

    every: int
    durable_every: int
    replicate_max_stride: int

    @classmethod
    def of(cls, cfg: SnapshotConfig, auto: "AutoSchedule | None") -> "Intervals":
        def now(tier: str, value: int | str) -> int:
            if value != AUTO:
                return int(value)
            return auto.every(tier) if auto is not None and tier in auto.tiers else 0
        # An auto memory tier replicates every version (launch: the chooser is its budget).
        stride = 1 if cfg.every == AUTO else cfg.replicate_max_stride
        return cls(now("memory", cfg.every), now("durable", cfg.durable_every), stride)


@dataclass
class _Tier:
    every: int
    last: int = 0            # step of this tier's previous version (or the restored one)
    cost_s: float = 0.0      # newest measurements (this rank's)
    bytes: float = 0.0
    link_bytes_s: float = 0.0
    extra_cost_s: float = 0.0  # the memory tier's etcd commit, measured by the agent


class AutoSchedule:
    """A worker's side of the auto intervals: when each auto tier is due, what versions cost,
    the agreement and the choice. ``group``: a process group for the one small all-reduce of
    each choice (gloo; None with one rank)."""

    def __init__(self, cfg: SnapshotConfig, tiers: tuple[str, ...], events: Any, rank: int, group: Any = None):
        self.limits, self.events, self.rank, self.group = Limits.from_config(cfg), events, rank, group
        self.tiers = {t: _Tier(self.limits.lo) for t in tiers}
        self.failures = 0
        self.seconds_before = 0.0            # training seconds of earlier incarnations
        self.started = time.monotonic()
        self.decided = False
        self.versions = 0                    # captures for an auto tier since the last choice
        self._step_t: float | None = None    # when the previous step ended
        self._blocked = 0.0                  # the capture since then (not a training step's time)
        self._window = [0, 0.0]              # steps, their seconds (captures left out) since the last choice
        self.last_choice: dict[str, Choice] = {}

    # -- when ----------------------------------------------------------------------
    def due(self, tier: str, step: int) -> bool:
        t = self.tiers[tier]
        return step - t.last >= t.every

    def every(self, tier: str) -> int:
        return self.tiers[tier].every

    def text(self) -> str:
        """For the progress line: each auto tier's current interval."""
        return " ".join(f"{t} {s.every}" for t, s in self.tiers.items()) + " (auto)"

    # -- measurements ---------------------------------------------------------------
    def step_ended(self) -> None:
        """Called once per step boundary, before any capture of the step."""
        now = time.monotonic()
        if self._step_t is not None:
            self._window[0] += 1
            self._window[1] += max(now - self._step_t - self._blocked, 0.0)
        self._step_t, self._blocked = now, 0.0

    def captured(self, step: int, tiers: tuple[str, ...], blocked_s: float) -> None:
        """A version of ``tiers`` was captured at ``step``; the step was blocked ``blocked_s``."""
        self._blocked += blocked_s
        mine = [self.tiers[n] for n in tiers if n in self.tiers]
        for t in mine:
            t.last = step
            t.cost_s = blocked_s if t.cost_s <= 0 else 0.5 * t.cost_s + 0.5 * blocked_s
        self.versions += 1 if mine else 0

    def link(self, tier: str, nbytes: float, seconds: float, extra_cost_s: float = 0.0) -> None:
        """The newest transfer of ``tier``'s version over its link (and, for the memory tier, the
        seconds of its etcd commit, a cost to the host that trains)."""
        t = self.tiers.get(tier)
        if t is None:
            return
        t.extra_cost_s = max(extra_cost_s, 0.0)
        if nbytes > 0 and seconds > 0:
            t.bytes, t.link_bytes_s = float(nbytes), nbytes / seconds

    def seconds(self) -> float:
        return self.seconds_before + (time.monotonic() - self.started)

    # -- history across incarnations -------------------------------------------------
    def history(self, ended: bool = False) -> dict:
        """What a version carries for the next incarnation (rank 0's is kept)."""
        return {"failures": self.failures, "seconds": round(self.seconds(), 3), "ended": ended,
                "every": {t: s.every for t, s in self.tiers.items()}}

    def restored(self, step: int, history: Any, durable_step: int | None, rollback: bool) -> None:
        """A restore loaded ``step`` (``durable_step``: the newest durable version at or below
        it). At start-up the version's history is taken up, and the restart counts as a failure
        unless that version was the previous incarnation's last save; a rollback is one more."""
        h = history if isinstance(history, dict) else {}
        if rollback:
            self.failures += 1
        else:
            self.failures = int(h.get("failures", 0)) + (0 if h.get("ended") else 1)
            self.seconds_before, self.started = float(h.get("seconds", 0.0)), time.monotonic()
            for name, every in (h.get("every") or {}).items():
                if name in self.tiers and isinstance(every, int):
                    self.tiers[name].every = min(max(every, self.limits.lo), self.limits.hi)
        for name, t in self.tiers.items():
            # no durable version yet: the durable tier counts from the run's start
            t.last = (durable_step if durable_step is not None else 0) if name == "durable" else step
        self.decided, self.versions, self._window, self._step_t = False, 0, [0, 0.0], None

    # -- the choice --------------------------------------------------------------------
    def maybe_choose(self, step: int) -> bool:
        """After a capture (every rank at the same step): choose again when due. Collective
        when it chooses (the trigger depends only on agreed steps)."""
        if self.versions == 0 or (self.decided and self.versions < RETUNE) or self._window[0] < 1:
            return False
        steps, wall = self._window
        names = sorted(self.tiers)
        # Rank-local inputs, reduced with MAX: the slowest step, the costliest version, the
        # slowest link (a throughput enters negated), the most failures any rank knows of.
        local = [wall / steps, float(self.failures), self.seconds()]
        for n in names:
            t = self.tiers[n]
            local += [t.cost_s + t.extra_cost_s, t.bytes,
                      -t.link_bytes_s if t.link_bytes_s > 0 else -math.inf]
        agreed = self._agree(local)
        step_s, failures, seconds = agreed[0], int(agreed[1]), agreed[2]
        self.failures = failures
        for i, n in enumerate(names):
            cost, nbytes, neg_link = agreed[3 + 3 * i: 6 + 3 * i]
            m = Measured(step_s, cost, nbytes, -neg_link if math.isfinite(neg_link) else 0.0, failures, seconds)
            c = choose(m, self.limits)
            t = self.tiers[n]
            if self.rank == 0 and (c.every != t.every or n not in self.last_choice):
                self.events.emit("snapshot_interval", tier=n, step=step, every=c.every, previous=t.every,
                                 bound=c.bound, young_daly=round(c.young_daly, 3),
                                 budget_floor=round(c.budget_floor, 3), mtbf_s=round(c.mtbf_s, 1),
                                 failures=failures, seconds=round(seconds, 1), cost_s=round(cost, 6),
                                 step_s=round(step_s, 6), bytes=int(nbytes),
                                 link_mb_s=round(m.link_bytes_s / 1e6, 3), budget=self.limits.budget)
            t.every = c.every
            self.last_choice[n] = c
        self.decided, self.versions, self._window = True, 0, [0, 0.0]
        return True

    def _agree(self, values: list[float]) -> list[float]:
        if self.group is None:
            return values
        # -inf (no link measured) does not survive every backend's MAX: a finite sentinel.
        t = torch.tensor([v if math.isfinite(v) else -1e300 for v in values], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [v if v > -1e299 else -math.inf for v in t.tolist()]


def schedule_group(cfg: SnapshotConfig, world: int) -> Any:
    """The gloo group of the auto intervals' all-reduce, made by every rank (collective), or
    None when no tier is auto or the job has one rank."""
    if not cfg.auto_tiers or world <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")

