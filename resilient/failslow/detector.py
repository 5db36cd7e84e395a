"""Detection and attribution of stragglers from every rank's step timings.

Each observation is one row per rank of [compute, wait, data, snapshot, wall,
queued] (:data:`~resilient.failslow.api.PHASES`) for the same steps. What a
rank did other than wait for the others or for a CPU is its *own* time
(``wall - wait - queued``; without the run-queue delay, the per-step noise of
the ranks' ratios on this 2-core shared host falls from σ 0.32 to 0.08). Three
signals, each judged against the job's own history, never against a constant:

- **a slow rank** (device): its own time, divided by the median of the other
  ranks', rises above what it was for that rank while healthy (a pipeline's last
  stage always computes more: its own baseline says so). The others wait for
  it; it waits for nobody. Across ranks the common load of a host shared by
  every rank cancels; a whole job that slows down is not a straggler.
- **a slow host**: the same for every rank of one node at once (a noisy
  neighbour, a throttled CPU or power cap on the node): the cause is the host.
- **a slow link**: nobody's own time rose, but even the rank that waited least
  waits longer (the step is longer than its slowest rank's own work): the time
  goes into moving bytes. Or a process slow inside the collectives too: the
  detector's ``link`` verdict is a suspicion, which the monitor settles with
  :mod:`~resilient.failslow.probe` (each rank's compute and each ring edge timed).

Evidence per signal is a one-sided CUSUM of its log factor beyond
``log(threshold)``, fed by the median of its last three values (one step's
hiccup on a loaded host is not evidence); a verdict needs ``evidence``. After a
verdict the signal is re-armed only when its evidence fell back to zero.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence

from resilient.failslow.api import PHASES, FailSlowConfig, FailSlowError, Straggler

COMPUTE, WAIT, DATA, SNAPSHOT, WALL, QUEUED = range(6)
_TINY = 1e-6       # seconds: below this a time is noise of the clock
_BASELINE = 64     # healthy observations kept per signal for its baseline
# Evidence one observation can add at most (beyond the signal's k): a burst of two steps
# at any factor is a hiccup (with the median of three it adds twice this), three steps at
# 2x are not.
_MAX_STEP = math.log(2.0)
# The least slowdown that adds evidence is also at least this many robust standard
# deviations of the signal's own healthy history: on a host where a rank's share of the
# step is a small difference of large, noisy numbers, a 1.3x is not told from noise quickly
# and is not claimed (measured: the demo's 3 ranks in network namespaces on 2 shared cores).
_NOISE_SIGMAS = 1.2
_NOISE_LEVEL = 6.0   # ... and the evidence needed, at least this many
# A rank whose evidence reached the configured level but not its noise's is a suspect: the
# monitor times every rank's compute (the probe) and names it only if the probe finds it slow.
# Why: on a host this noisy the noise level is 4x the configured one (the soak: 5-7 against
# 1.5, a rank's own time swinging between 0 and 200 ms from step to step), and a slow host
# 4x for 10 s was not named at all. A suspect is not suspected again for this many
# observations (a probe costs ~0.1-0.3 s of every rank's time).
SUSPECT_COOLDOWN = 20


@dataclass
class _Signal:
    """One CUSUM over a log factor, with its own healthy baseline."""

    recent: deque = field(default_factory=lambda: deque(maxlen=3))
    baseline: deque = field(default_factory=lambda: deque(maxlen=_BASELINE))
    score: float = 0.0
    since: int | None = None      # observation index where the current evidence began
    raised: bool = False          # a verdict stands until the evidence is back at zero
    excess: float = 0.0           # the filtered log factor beyond baseline, last observation
    cap: float = 0.0              # the configured evidence level
    level: float = 0.0            # the evidence level for this signal's noise (≥ cap)

    def update(self, x: float, k: float, learning: bool, quiet: bool) -> None:
        """``quiet``: no signal of the job holds evidence (while one rank is slow, the
        others' ratios to it are no baseline to learn)."""
        self.recent.append(x)
        if learning:
            self.baseline.append(x)
            return
        centre = median(self.baseline)
        spread = 1.4826 * median(abs(b - centre) for b in self.baseline)
        k = max(k, _NOISE_SIGMAS * spread)
        self.level = max(self.cap, _NOISE_LEVEL * spread)
        y = median(self.recent) - centre
        self.excess = y
        if y < k and quiet:   # healthy: the baseline follows slow drifts
            self.baseline.append(x)
        # the cap is on the excess beyond k: capping y itself, a noisy signal's k (≥ log 2 when
        # its spread is ≥ 0.58) let no step add evidence at any factor (the soak: a rank 8-24x
        # the others for 5 steps, evidence 0)
        self.score = max(0.0, self.score + min(y - k, _MAX_STEP))
        if self.raised:   # a verdict stands: no more evidence needed, re-arm soon after recovery
            self.score = min(self.score, self.level)
        if self.score == 0.0:
            self.since, self.raised = None, False

    @property
    def factor(self) -> float:
        return math.exp(max(0.0, self.excess))


def medians_without_each(values: Sequence[float]) -> list[float]:
    """For each i, the median of ``values`` without ``values[i]``: one sort, not one per
    rank (a job of 1,000 ranks judges every step)."""
    n = len(values)
    order = sorted(range(n), key=lambda i: values[i])
    ranked = [values[i] for i in order]
    lo, hi = (n - 2) // 2, (n - 1) // 2   # the middle of the n - 1 left

    def at(j: int, pos: int) -> float:   # item j of the sorted values with position pos removed
        return ranked[j if j < pos else j + 1]

    out = [0.0] * n
    for pos, i in enumerate(order):
        out[i] = (at(lo, pos) + at(hi, pos)) / 2
    return out


class Detector:
    """Feed :meth:`observe` one timing matrix per exchange; it returns the new verdicts.

    Deterministic: the same matrices give the same verdicts. One runs, on rank 0
    (:mod:`~resilient.failslow.courier`); every rank acts on its verdicts together."""

    def __init__(self, cfg: FailSlowConfig, nodes: Sequence[str]):
        cfg.validate()
        if len(nodes) < 2:
            raise FailSlowError("fail-slow detection needs at least 2 ranks to compare")
        self.cfg = cfg
        self.nodes = list(nodes)
        self.world = len(nodes)
        self.k = math.log(cfg.threshold)
        self.h = cfg.evidence
        self.ranks = [_Signal(cap=self.h) for _ in range(self.world)]
        self.link = _Signal(cap=self.h)
        self.seen = 0
        self.last_own: list[float] = []
        self.suspect_from = [0] * self.world   # the observation (self.seen) from which a rank may be suspected again
        self.node_ranks: dict[str, list[int]] = {}
        for r, n in enumerate(self.nodes):
            self.node_ranks.setdefault(n, []).append(r)

    def observe(self, step: int, rows: Sequence[Sequence[float]]) -> list[Straggler]:
        if len(rows) != self.world:
            raise FailSlowError(f"timing matrix has {len(rows)} rows for {self.world} ranks")
        if any(row[WALL] <= 0 for row in rows):
            return []   # an exchange that carried no complete interval (the first one)
        # what the rank itself needed: neither waiting for the others nor for a CPU that
        # another process held (the run-queue delay: a shared host's noise, not this rank)
        own = [max(_TINY, row[WALL] - row[WAIT] - row[QUEUED]) for row in rows]
        self.last_own = own
        learning = self.seen < self.cfg.warmup
        quiet = all(s.score < self.h / 2 and not s.raised for s in [*self.ranks, self.link])
        self.seen += 1
        for r, (sig, others) in enumerate(zip(self.ranks, medians_without_each(own))):
            sig.update(math.log(own[r] / max(_TINY, others)), self.k, learning, quiet)
        wall = median(row[WALL] for row in rows)
        least_wait = min(row[WAIT] for row in rows)
        self.link.update(math.log(wall / max(_TINY, wall - least_wait)), self.k, learning, quiet)
        for sig in [*self.ranks, self.link]:
            if sig.score > 0 and sig.since is None:
                sig.since = self.seen
        return self._verdicts(step, rows, own)

    def state(self) -> dict:
        """What the last observation left: each rank's own seconds, and per signal (each rank's,
        the link's) [evidence, the level a verdict needs, the filtered log excess, raised]."""
        def sig(s: _Signal) -> list:
            return [round(s.score, 4), round(max(self.h, s.level), 4), round(s.excess, 4), s.raised]

        return {"own": [round(o, 6) for o in self.last_own], "learning": self.seen <= self.cfg.warmup,
                "ranks": [sig(s) for s in self.ranks], "link": sig(self.link)}

    def rearm(self, ranks: Sequence[int]) -> None:
        """Forget the verdict on these ranks: if they are still slow, the evidence builds up
        again and a new verdict comes (a ``replace`` that found no seat asks again later)."""
        for r in ranks:
            sig = self.ranks[r]
            sig.raised, sig.score, sig.since = False, 0.0, None

    def rearm_link(self) -> None:
        """Forget the link verdict (the probe could not locate it): if the link is still slow,
        the evidence builds up again, and the probe runs again."""
        self.link.raised, self.link.score, self.link.since = False, 0.0, None

    def hold(self, ranks: Sequence[int]) -> None:
        """A verdict on these ranks was reached another way (the probe): as if raised here."""
        for r in ranks:
            sig = self.ranks[r]
            sig.raised, sig.score = True, max(sig.score, self.h)

    def _verdicts(self, step: int, rows: Sequence[Sequence[float]], own: list[float]) -> list[Straggler]:
        out: list[Straggler] = []
        fresh = [r for r, s in enumerate(self.ranks) if s.score >= max(self.h, s.level) and not s.raised]
        done: set[int] = set()
        for r in sorted(fresh, key=lambda r: -self.ranks[r].score):
            if r in done:
                continue
            node = self.nodes[r]
            mates = self.node_ranks[node]
            # every rank of the node slow together (and the node is not the whole job): the host
            host = (len(mates) > 1 and len(mates) < self.world
                    and all(self.ranks[m].score >= self.h / 2 for m in mates))
            slow = mates if host else [r]
            for m in slow:
                self.ranks[m].raised = True
                done.add(m)
            out.append(self._rank_verdict(step, r, "host" if host else "device", slow, rows, own))
        # at most one suspect an observation (each costs a probe): the one with most evidence
        suspects = [r for r, sig in enumerate(self.ranks) if r not in done and not sig.raised
                    and self.seen >= self.suspect_from[r] and self.h <= sig.score < sig.level]
        if suspects:
            r = max(suspects, key=lambda r: self.ranks[r].score)
            self.suspect_from[r] = self.seen + SUSPECT_COOLDOWN
            suspect = self._rank_verdict(step, r, "device", [r], rows, own)
            suspect.evidence["suspected"] = True   # the probe decides (monitor.py)
            out.append(suspect)
        if self.link.score >= max(self.h, self.link.level) and not self.link.raised:
            self.link.raised = True
            waits = [row[WAIT] for row in rows]
            out.append(Straggler(
                step=step, cause="link", factor=self.link.factor, slow_rank=None, slow_ranks=[], slow_node=None,
                steps_of_evidence=self.seen - (self.link.since or self.seen) + 1,
                evidence={"least_wait_seconds": round(min(waits), 6), "wait_median": round(median(waits), 6),
                          "wall_seconds": round(median(r[WALL] for r in rows), 6),
                          "slowest_own_seconds": round(max(own), 6), "score": round(self.link.score, 3)}))
        return out

    def _rank_verdict(self, step: int, r: int, cause: str, slow: list[int], rows: Sequence[Sequence[float]],
                      own: list[float]) -> Straggler:
        sig, mates = self.ranks[r], self.node_ranks[self.nodes[r]]
        waits = [row[WAIT] for row in rows]
        return Straggler(
            step=step, cause=cause, factor=sig.factor, slow_rank=r, slow_ranks=slow, slow_node=self.nodes[r],
            steps_of_evidence=self.seen - (sig.since or self.seen) + 1,
            evidence={"own_seconds": round(own[r], 6), "others_own_median": round(median(own[:r] + own[r + 1:]), 6),
                      "wait_seconds": round(rows[r][WAIT], 6), "queued_seconds": round(rows[r][QUEUED], 6),
                      "others_wait_median": round(median(waits[:r] + waits[r + 1:]), 6),
                      "phases": dict(zip(PHASES, (round(v, 6) for v in rows[r]))),
                      "score": round(sig.score, 3), "level": round(max(self.h, sig.level), 3),
                      "mates_scores": {str(m): round(self.ranks[m].score, 3) for m in mates} if len(mates) > 1 else {}})
