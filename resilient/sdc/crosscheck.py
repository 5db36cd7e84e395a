"""Cross-device replay, sampled: what a device computes, recomputed on another device.

The checks of what travels (reductions, replicas) and rests (parameters, optimizer
state) cannot see a device that computes a wrong forward: attention, a norm, a
softmax, a GEMM whose result is consistently wrong is computed *into* the
gradients. Recomputing the same step on another device can: on the same state and
the same batch, deterministic kernels (CPU) give the same answer bit for bit.

**Sampling.** At every ``period``-th step (decided from the step number alone, so
every rank takes part in the same sampled step and no exchange can deadlock) every
rank recomputes the forward of its predecessor's batch (rank ``i`` that of rank
``i-1 mod W``: a rotation, so each forward's collectives, FSDP2's all-gathers,
line up on every rank), under the predecessor's pre-step RNG state, without
gradients, and the loss it gets is compared bitwise with the loss the predecessor's
training forward got. Every rank is checked at every sampled step, so a persistent
fault on any rank is found within ``period`` steps of its onset. ``period`` follows
a cost budget (``sdc.cross_check_budget``, a fraction of the step's time): a
forward is about a third of a training step, measured at each sample and agreed
(the largest over ranks) in the same exchange; capped at ``cross_check_max_period``
(the detection bound) — what that cap costs is said at start.

**Attribution** (:func:`attribute`). One pair that disagrees says that one of two
devices is wrong, not which. With three or more ranks:

* a rank whose own original and whose recompute of its predecessor both disagree
  (it is the subject of one mismatch and the checker of the other) is the odd one
  out: a device that computes wrong answers computes its own step and its peer's
  wrong;
* any other mismatch is recomputed once more on a third device (a second rotation,
  rank ``i`` recomputing ``i-2``'s batch): the majority of three answers names the
  odd one.

With two ranks, or when no majority forms, the mismatch is a **tie**: both ranks are
reported as suspects (``attributed: false``) and replayed on their own devices — a
transient shows as a different answer there; a tie is never a reason to quarantine.
The suspicions join the monitor's verdicts (replay, quarantine, rollback).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from resilient.sdc.api import KIND_CROSS, Suspicion
from resilient.sdc.sampling import SampledSteps, period_for  # noqa: F401 - period_for: public here too

FORWARD_SHARE = 1 / 3   # a forward's share of a training step, before a measurement says otherwise


def loss_bits(loss: torch.Tensor | float | None) -> int:
    """The bit pattern of a loss (float32 or float64) as an int64; -1 for none."""
    if loss is None:
        return -1
    t = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss), dtype=torch.float64)
    t = t.to("cpu")
    if t.dtype == torch.float64:
        return int(t.view(torch.int64))
    return int(t.to(torch.float32).view(torch.int32))


def attribute(world: int, original: Sequence[int], first: Sequence[int],
              second: Sequence[int] | None = None) -> list[Suspicion]:
    """Suspicions from one sampled step (module docstring). ``original[r]``: rank r's
    training loss bits; ``first[c]``: c's recompute of ``(c-1) % world``'s batch;
    ``second[c]``: c's recompute of ``(c-2) % world``'s (None: no second round).
    Pure and identical on every rank given the same gathered numbers."""
    mism = [c for c in range(world) if first[c] != original[(c - 1) % world]]   # checker c disagrees with subject c-1
    out: list[Suspicion] = []
    explained: set[int] = set()   # checkers whose mismatch is explained
    if world >= 3:
        # a rank that disagrees as a checker (c = x) and is disagreed with as a subject (c = x+1)
        for x in range(world):
            if x in mism and (x + 1) % world in mism:
                out.append(_sus(x, "wrong as subject and as checker", True, original, first, (x + 1) % world))
                explained |= {x, (x + 1) % world}
    for c in mism:
        if c in explained:
            continue
        s = (c - 1) % world
        if second is not None and world >= 3:
            third = (s + 2) % world   # the rank that recomputed s's batch in the second round
            if second[third] == first[c] != original[s]:
                out.append(_sus(s, "a third device agrees with the checker", True, original, first, c, third))
                continue
            if second[third] == original[s] != first[c]:
                out.append(_sus(c, "a third device agrees with the subject", True, original, first, c, third))
                continue
        for r in (s, c):   # a tie: both are suspects, neither is attributed
            out.append(_sus(r, "tie", False, original, first, c))
    one: dict[int, Suspicion] = {}   # one per rank; an attributed one wins over a tie
    for x in out:
        if x.rank not in one or (x.evidence["attributed"] and not one[x.rank].evidence["attributed"]):
            one[x.rank] = x
    return [one[r] for r in sorted(one)]


def _sus(rank: int, why: str, attributed: bool, original, first, checker: int, third: int | None = None) -> Suspicion:
    subject = (checker - 1) % len(original)
    return Suspicion(step=-1, rank=rank, kind=KIND_CROSS, tensor="loss",
                     evidence={"attributed": attributed, "why": why, "subject": subject, "checker": checker,
                               **({"third": third} if third is not None else {}),
                               "subject_bits": original[subject], "checker_bits": first[checker]})


@dataclass
class CrossCheck:
    """The sampled cross-device replay of one rank (module docstring).

    ``recompute(inputs, targets)`` runs the loss of a batch without gradients, as the
    training forward computes it; ``group``: the world group the forwards span."""

    budget: float
    max_period: int
    rank: int
    world: int
    group: object = None
    spent_s: float = 0.0
    _rng: torch.Tensor | None = None
    steps: SampledSteps = field(init=False)   # the sampled steps (sampling.py): the budget's, within the bound

    def __post_init__(self) -> None:
        self.steps = SampledSteps(self.budget, self.max_period, FORWARD_SHARE)

    @property
    def period(self) -> int:
        return self.steps.period

    @property
    def active(self) -> bool:
        return self.world > 1 and self.steps.active

    def due(self, step: int) -> bool:
        """Is ``step`` (1-based: the step being run) a sampled one? Same on every rank: the
        period is agreed in the exchange, and a rollback's repeated steps wait for the next."""
        return self.active and self.steps.due(step)

    def note_rng(self) -> None:
        """Before a sampled step's forward: the RNG state its dropout (if any) will start from."""
        self._rng = torch.get_rng_state()

    def run(self, step: int, loss, batch: Sequence[torch.Tensor],
            recompute: Callable[..., torch.Tensor | None], step_seconds: float) -> list[Suspicion]:
        """The exchange of a sampled step (collective: every rank, the same step)."""
        t0 = time.perf_counter()
        mine = [t.contiguous() for t in batch]
        batches = [[torch.empty_like(t) for _ in range(self.world)] for t in mine]
        for t, out in zip(mine, batches):
            dist.all_gather(out, t, group=self.group)
        rng = self._rng if self._rng is not None else torch.get_rng_state()
        rngs = [torch.empty_like(rng) for _ in range(self.world)]
        dist.all_gather(rngs, rng, group=self.group)

        def forward_of(subject: int) -> int:
            own = torch.get_rng_state()
            torch.set_rng_state(rngs[subject])
            try:
                with torch.no_grad():
                    return loss_bits(recompute(*[b[subject] for b in batches]))
            finally:
                torch.set_rng_state(own)

        first = forward_of((self.rank - 1) % self.world)
        spent = time.perf_counter() - t0
        share = spent / max(step_seconds, 1e-9)
        row = torch.tensor([loss_bits(loss), first, int(share * 1e6)], dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).tolist()
        original, firsts = [r[0] for r in table], [r[1] for r in table]
        second = None
        if self.world >= 3 and any(firsts[c] != original[(c - 1) % self.world] for c in range(self.world)):
            b = torch.tensor([forward_of((self.rank - 2) % self.world)], dtype=torch.int64)
            seconds = [torch.empty_like(b) for _ in range(self.world)]
            dist.all_gather(seconds, b, group=self.group)
            second = [int(x) for x in torch.cat(seconds).tolist()]
        self.spent_s += time.perf_counter() - t0
        # the largest measured share over ranks: every rank computes the same next period
        self.steps.measured(step, max(r[2] for r in table) / 1e6)
        self._rng = None
        sus = attribute(self.world, original, firsts, second)
        for s in sus:
            s.step = step
        return sus

    def describe(self) -> str:
        return (f"cross-device replay every {self.period} steps (each rank's forward recomputed by its "
                f"neighbour; budget {100 * self.budget:g}% of step time at a forward ≈ {FORWARD_SHARE:.2f} "
                f"step, re-measured at each sample; a persistent fault is found within {self.max_period} steps "
                "at most)")
