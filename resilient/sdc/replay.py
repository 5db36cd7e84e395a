"""Replay: recompute a suspect step and let the difference decide.

A check only *suspects*. A wrong answer that comes out again when the step is
recomputed from the same pre-step state on the same device is a bad device
(PERSISTENT); one that does not is a one-off (TRANSIENT); a result that comes
out the same and passes the exact checks was never wrong (FALSE_ALARM); a
difference no larger than rounding cannot matter (HARMLESS). The transitions
are spelled out on :class:`~resilient.sdc.api.Verdict`.

What is compared is a :class:`Fingerprint` of the suspect rank's tensors (its
local gradient shards, for a step caught after backward): per tensor the exact
bit-sum plus float64 sum / L1 / max-magnitude, so "the same answer" means
bitwise the same, and the size of a difference can be held against the
rounding bound. Training is deterministic (DESIGN: "Determinism is the test
oracle"), so a healthy device reproduces its own answer bit for bit.

:class:`ReplayStateMachine` holds the per-step state (IDLE → SUSPECT →
REPLAYING → IDLE) and the per-device history that escalates a device with
repeated transients to PERSISTENT. :func:`replay_step` is the single-process
form for library users: give it the original fingerprint, a ``recompute()``
returning a new one, and a ``check()`` that says whether a fingerprint passes.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from resilient.sdc.api import (KIND_AT_REST, KIND_GEMM, KIND_GRAD_AT_REST, KIND_PROBE, KIND_REDUCTION, KIND_REPLICA,
                               KIND_STATE_AT_REST, SdcError, Suspicion, Verdict)
from resilient.sdc.checksums import AMAX, BITS, L1, SUM, harmless_bound, local, stats

# kinds whose re-occurrence on replay is decisive; the others are heuristics
EXACT_KINDS = frozenset({KIND_REDUCTION, KIND_REPLICA, KIND_AT_REST, KIND_STATE_AT_REST, KIND_GRAD_AT_REST, KIND_PROBE,
                         KIND_GEMM})


@dataclass(frozen=True)
class TensorPrint:
    bits: int
    sum: float
    l1: float
    amax: float
    numel: int
    dtype: str


Fingerprint = dict  # name -> TensorPrint


def fingerprint(named: Iterable[tuple[str, torch.Tensor | None]]) -> Fingerprint:
    """The rank-local fingerprint of ``named`` tensors (one host sync)."""
    named = [(n, t) for n, t in named if t is not None]
    rows = stats([t for _, t in named])
    out = {}
    for (n, t), row in zip(named, rows):
        out[n] = TensorPrint(bits=int(row[BITS:BITS + 1].view(torch.int64)), sum=float(row[SUM]), l1=float(row[L1]),
                             amax=float(row[AMAX]), numel=local(t).numel(), dtype=str(local(t).dtype).replace("torch.", ""))
    return out


class Match(enum.Enum):
    SAME = "same"           # bitwise identical
    ROUNDING = "rounding"   # differs, but by no more than one rounding could
    DIFFERENT = "different"


def compare(a: Fingerprint, b: Fingerprint) -> tuple[Match, dict]:
    """How two fingerprints of the same tensors differ, with the worst tensor."""
    if set(a) != set(b):
        return Match.DIFFERENT, {"names": sorted(set(a) ^ set(b))}
    worst, detail = Match.SAME, {}
    for n in a:
        x, y = a[n], b[n]
        if x.bits == y.bits and (x.sum == y.sum or (math.isnan(x.sum) and math.isnan(y.sum))):
            continue  # the same answer, a reproducible NaN included (instability, not hardware)
        d = abs(x.sum - y.sum)
        bound = harmless_bound(getattr(torch, x.dtype), max(x.amax, y.amax), max(x.l1, y.l1), x.numel)
        m = Match.ROUNDING if math.isfinite(d) and math.isfinite(x.amax + y.amax) and d <= bound else Match.DIFFERENT
        if m is Match.DIFFERENT or worst is Match.SAME:
            worst, detail = m, {"tensor": n, "dsum": d, "harmless_bound": bound}
        if m is Match.DIFFERENT:
            break
    return worst, detail


def classify(match: Match, still_suspect: bool) -> Verdict:
    """The transition table of :class:`Verdict` for one rank."""
    if still_suspect:
        return Verdict.PERSISTENT
    if match is Match.SAME:
        return Verdict.FALSE_ALARM
    if match is Match.ROUNDING:
        return Verdict.HARMLESS
    return Verdict.TRANSIENT


class State(enum.Enum):
    IDLE = "idle"
    SUSPECT = "suspect"
    REPLAYING = "replaying"


@dataclass
class ReplayStateMachine:
    """Per-step replay state and per-device fault history.

    ``suspect()`` enters SUSPECT with the step's suspicions and this rank's
    original fingerprint; ``begin()`` moves to REPLAYING (the loop recomputes);
    ``conclude()`` turns the per-rank replay results into verdicts and returns
    to IDLE. A device with ``max_transients`` TRANSIENT verdicts is escalated to
    PERSISTENT: a device that keeps flipping bits is bad even if each flip heals.
    """

    max_transients: int = 3
    state: State = State.IDLE
    step: int = -1
    suspicions: list[Suspicion] = field(default_factory=list)
    original: Fingerprint = field(default_factory=dict)
    replays: int = 0
    transients: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def suspect(self, step: int, suspicions: list[Suspicion], original: Fingerprint) -> None:
        if self.state is not State.IDLE and step != self.step:
            raise SdcError(f"replay of step {self.step} still open when step {step} became suspect; call conclude() first")
        self.state, self.step, self.suspicions, self.original, self.replays = State.SUSPECT, step, suspicions, original, 0

    def begin(self) -> None:
        if self.state is State.IDLE:
            raise SdcError("begin() without a suspect step")
        self.state = State.REPLAYING
        self.replays += 1

    def conclude(self, per_rank: dict[int, tuple[Match, bool]], devices: dict[int, str]) -> dict[int, Verdict]:
        """``per_rank``: rank -> (match of its replay vs original, still suspect on replay)."""
        if self.state is not State.REPLAYING:
            raise SdcError(f"conclude() in state {self.state.value}; call begin() and replay first")
        verdicts = {}
        for rank, (match, still) in sorted(per_rank.items()):
            v = classify(match, still)
            if v is Verdict.TRANSIENT:
                dev = devices.get(rank, f"rank{rank}")
                self.transients[dev] += 1
                if self.transients[dev] >= self.max_transients:
                    v = Verdict.PERSISTENT
            verdicts[rank] = v
        self.state = State.IDLE
        self.suspicions, self.original = [], {}
        return verdicts

    def record_transient(self, device: str) -> bool:
        """Count a healed fault not found by replay (e.g. parameters at rest); True = escalate."""
        self.transients[device] += 1
        return self.transients[device] >= self.max_transients


def replay_step(original: Fingerprint, recompute: Callable[[], Fingerprint],
                check: Callable[[Fingerprint], bool], *, max_replays: int = 1) -> tuple[Verdict, Fingerprint, dict]:
    """Single-process replay: recompute until a verdict, return (verdict, replayed, detail).

    ``check(fp)`` is True when ``fp`` passes the exact checks (agrees with the
    majority / the linear invariant). A persistent verdict is only reached after
    ``max_replays`` recomputations that still fail.
    """
    fp, detail = original, {}
    for _ in range(max(1, max_replays)):
        fp = recompute()
        match, detail = compare(original, fp)
        verdict = classify(match, not check(fp))
        if verdict is not Verdict.PERSISTENT:
            return verdict, fp, detail
    return Verdict.PERSISTENT, fp, detail
