"""Which steps a sampled check runs on: a period set by a cost budget, capped by a bound.

The checks of what a device computes (the cross-device replay, the checksummed GEMMs)
cost a share of a step when they run. Run every ``period``-th step, they cost
``share / period`` of the run: the period is the smallest that keeps this within the
budget, and never more than ``max_period``, so a persistent fault is found within that
many steps of its onset whatever the cost. The share is assumed until a sampled step
measures it, then re-measured at each sample.

Every rank must sample the same steps (one rank's checked step stalls the others that
wait for it in the next collective; the cross-device replay is itself collective): the
schedule depends on the step number and on shares agreed by every rank (the largest),
nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def period_for(cost_share: float, budget: float, max_period: int) -> int:
    """Steps between samples so that a check costing ``cost_share`` of a step takes at most
    ``budget`` of the run; no more than ``max_period`` (the detection bound)."""
    if budget <= 0:
        return max_period
    return max(1, min(max_period, math.ceil(cost_share / budget)))


@dataclass
class SampledSteps:
    """The sampled steps of one check (module docstring). ``assumed_share``: the check's
    cost as a share of a step until a sample measures it; ``first``: how many steps after
    the start (:meth:`starting_at`) the first sample comes (default: one period), early to
    measure the cost and to find the device clean before any fault, so that a rollback for
    a fault found later need not go back to the start."""

    budget: float
    max_period: int
    assumed_share: float
    first: int | None = None
    period: int = 0
    next_step: int = 0   # the next sampled step: the last one + the period then in force
    samples: int = 0
    share: float = 0.0   # the check's cost as a share of a step: assumed, then as last measured

    def __post_init__(self) -> None:
        self.share = self.assumed_share
        self.period = period_for(self.share, self.budget, self.max_period)
        self.next_step = self.period
        self.starting_at(0)

    @property
    def active(self) -> bool:
        return self.budget > 0 and self.max_period > 0

    def starting_at(self, step: int) -> None:
        """The loop starts (or resumes) after step ``step``: before any sample, the first one
        comes ``first`` steps in."""
        if self.samples == 0 and self.first is not None:
            self.next_step = step + min(self.first, self.period)

    def due(self, step: int) -> bool:
        """Is ``step`` (1-based: the step being run) a sampled one? A rollback's repeated
        steps wait for the next."""
        return self.active and step >= self.next_step

    def measured(self, step: int, share: float) -> None:
        """Sampled step ``step`` cost ``share`` of a step (agreed: the same on every rank)."""
        self.samples += 1
        self.share = share
        self.period = period_for(share, self.budget, self.max_period)
        self.next_step = step + self.period

    def cost(self) -> float:
        """The share of the run the check takes at the period in force."""
        return self.share / self.period if self.active else 0.0
