"""Fail-slow detection: its knobs, its verdict, its error.

A synchronous job runs at the speed of its slowest rank. ``[failslow]`` turns
on the per-rank step timing (:mod:`~resilient.failslow.timing`), its journey to
rank 0 beside the loop (:mod:`~resilient.failslow.courier`), the detector
(:mod:`~resilient.failslow.detector`) and the policy
(:mod:`~resilient.failslow.policy`). A verdict is a ``straggler`` event
(docs/events.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resilient.configbase import knob
from resilient.errors import ConfigError, ResilientError

CAUSES = ("device", "link", "host")
# report: a `straggler` event only; replace: also hand the slow node's seat to a warm spare
# (or shrink) when the cost model says it pays (resilient.failslow.policy, .replace)
POLICIES = ("report", "replace")

# The numbers each rank contributes per step, in this order: seconds of the step
# interval spent computing, blocked in collectives (waiting for the others), loading data
# (``job.phase("data")``) and capturing snapshots; the step interval's wall time; and the
# time the rank was runnable but another process held the CPU (run-queue delay: part of
# compute, data and snapshot, not of wait).
PHASES = ("compute", "wait", "data", "snapshot", "wall", "queued")


class FailSlowError(ResilientError):
    """Fail-slow detection was configured or used in a way that cannot work (says the fix)."""


@dataclass
class FailSlowConfig:
    """``[failslow]``: find the slow rank, node or link, name it, act when acting pays."""

    enable: bool = knob(True, "time each rank's step phases (compute, waiting in collectives, data, snapshot) and look for stragglers; a thread beside the loop gathers the numbers on rank 0")
    every: int = knob(1, "steps between timing exchanges (each carries the sum of the steps since the last): raise it on very large jobs, where rank 0 gathers and judges 48 bytes per rank each time")
    warmup: int = knob(8, "steps each rank's own baseline is learnt over before anything is judged (a pipeline's last stage computes more than the others: that is its normal)")
    threshold: float = knob(1.1, "smallest slowdown factor (against the other ranks, relative to the rank's own baseline) that adds evidence")
    evidence: float = knob(1.5, "evidence (a CUSUM of log slowdown factors beyond `threshold`, fed by the median of the last 3 steps) that raises a straggler event: a 2x slow rank needs ~4 steps, a 1.3x one ~11 (bench/failslow.py)")
    policy: str = knob("report", "what to do about a straggler: report (a `straggler` event carrying the cost model's decision: would replacing the slow node pay over the remaining run?) or replace (when it pays and the cause is a device or host: the slow node leaves, marked, and a warm spare takes its seat, or the job shrinks above its minimum nodes; never for a link)", choices=POLICIES)
    reform_seconds: float = knob(0.0, "cost model: seconds a re-form costs the whole job; 0 = measured (this worker's time from process start to its first step)")
    min_remaining_steps: int = knob(0, "cost model: never act with fewer steps left than this (0: the arithmetic alone decides)")
    rejoin_probes: int = knob(3, "replace: healthy compute probes in a row a node marked slow needs before it rejoins (as a spare)")
    trace: bool = knob(False, "rank 0 writes the detector's state at every exchange (each rank's own time, each signal's evidence, the level it must reach, its filtered excess) to failslow-trace.jsonl in the run dir: why a slowdown was named when it was, or not at all")
    rejoin_interval: float = knob(5.0, "replace: seconds between a marked node's compute probes")

    def validate(self, source: str = "[failslow]") -> None:
        """Raise :class:`ConfigError` for values that cannot work."""
        if self.every < 1:
            raise ConfigError(f"{source}: every = {self.every}; it must be ≥ 1 (1 = exchange at every step)")
        if self.warmup < 2:
            raise ConfigError(f"{source}: warmup = {self.warmup}; it must be ≥ 2 steps to learn a baseline")
        if not self.threshold > 1.0:
            raise ConfigError(f"{source}: threshold = {self.threshold}; a slowdown factor must be > 1 (e.g. 1.1)")
        if not self.evidence > 0:
            raise ConfigError(f"{source}: evidence = {self.evidence}; it must be > 0 (e.g. 2.0)")
        if self.rejoin_probes < 1:
            raise ConfigError(f"{source}: rejoin_probes = {self.rejoin_probes}; a marked node needs ≥ 1 healthy probe to rejoin")
        if not self.rejoin_interval > 0:
            raise ConfigError(f"{source}: rejoin_interval = {self.rejoin_interval}; give the seconds between probes (> 0, e.g. 5)")
        if self.min_remaining_steps < 0:
            raise ConfigError(f"{source}: min_remaining_steps = {self.min_remaining_steps}; use 0 (the arithmetic alone decides) or a number of steps")
        if self.reform_seconds < 0:
            raise ConfigError(f"{source}: reform_seconds = {self.reform_seconds}; use 0 for measured or a positive number")


@dataclass
class Straggler:
    """One detection: who is slow, why, by how much, and on what evidence."""

    step: int                      # the job's step when it was decided
    cause: str                     # device | link | host
    factor: float                  # slowdown of the job's step attributable to it (≥ 1)
    slow_rank: int | None          # the slow rank (link: the common end of the slow edges)
    slow_ranks: list[int]          # every rank judged slow (host: the node's ranks)
    slow_node: str | None
    steps_of_evidence: int         # steps from the first evidence to the verdict
    evidence: dict[str, Any] = field(default_factory=dict)

    def event_fields(self) -> dict:
        return {"step": self.step, "cause": self.cause, "factor": round(self.factor, 4),
                "slow_rank": self.slow_rank, "slow_ranks": self.slow_ranks, "slow_node": self.slow_node,
                "steps_of_evidence": self.steps_of_evidence, "evidence": self.evidence}
