"""Tensors at rest: state that nothing may change between two points of the loop.

Parameters and optimizer state are written by the optimizer step and by
nothing else until the next one; a reduced gradient is written by its
reduction and then only read until the optimizer consumes it. Any change in
between is corruption (a flipped memory bit, a stray kernel). So a hash taken
when the tensor is written and checked before it is used catches *every*
single-bit flip in between, exactly, with no rounding bound: the int32 bit-sum
of :func:`~.checksums.bitsum` changes by ±2**k for a flip of bit k.

:class:`AtRest` keeps one such record (names and bit-sums) for the monitor;
:func:`at_rest_delta` judges the size of a change from the bit-sum delta alone.
"""

from __future__ import annotations

from typing import Sequence

import torch

from resilient.sdc.api import KIND_AT_REST, KIND_STATE_AT_REST, Suspicion
from resilient.sdc.checksums import bits_view, local


def at_rest_delta(delta: int) -> tuple[int, bool]:
    """(the bit-sum change mod 2**32 as a signed number, harmless?) of a tensor at rest.

    One flip of bit ``k`` changes the bit-sum by ±2**k. A flip of mantissa bit
    ``k`` of an element ``x`` changes it by ``2**(k - mantissa_bits)·2**e(x) ≤
    2**(k - mantissa_bits)·amax``; the harmless bound of a rounding is
    ``4u·amax = 2**(1 - mantissa_bits)·amax`` (see
    :func:`~.checksums.harmless_bound`), so exactly the flips of bits 0 and 1
    are harmless, whatever the dtype and without the old value: the record
    needs the bit-sums only (no float64 pass).
    Anything else (a higher bit, several elements) is not.
    """
    delta = (delta + (1 << 31)) % (1 << 32) - (1 << 31)
    return delta, abs(delta) in (1, 2)


def bitsums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 host tensor of the int32 bit-sums of the local tensors (one device->host copy)."""
    return BitSums(tensors)()


class BitSums:
    """The bit-sums of a fixed list of tensors, computed again and again.

    Built once per list: the integer views of the local storages, and the 0-dim
    tensors (Adam's ``step`` counters) grouped per dtype, whose bit-sum is their
    bit pattern. On CPU every reduction kernel costs a few microseconds of
    dispatch whatever its size, and a model has hundreds of small state tensors:
    the views are cached, the scalars take one stack per dtype instead of one
    kernel each, and everything leaves the device in one copy. Valid while the
    tensors are updated in place (the optimizer does); :meth:`same` tells.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.sources = list(tensors)
        xs = [local(t) for t in self.sources]
        self.big = [i for i, x in enumerate(xs) if x.dim()]
        self.views = [bits_view(xs[i].detach()) for i in self.big]
        scalars: dict[torch.dtype, list[int]] = {}
        for i, x in enumerate(xs):
            if not x.dim():
                scalars.setdefault(x.dtype, []).append(i)
        self.scalars = [(idx, [xs[i].detach() for i in idx]) for idx in scalars.values()]
        order = self.big + [i for idx, _ in self.scalars for i in idx]
        self.order = torch.tensor(order, dtype=torch.int64)
        self.identity = order == list(range(len(order)))

    def same(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Still the same tensors, with the same local storage?"""
        return (len(tensors) == len(self.sources) and all(a is b for a, b in zip(tensors, self.sources))
                and all(local(self.sources[i]).data_ptr() == v.data_ptr() for i, v in zip(self.big, self.views)))

    def __call__(self) -> torch.Tensor:
        if not self.sources:
            return torch.zeros(0, dtype=torch.int64)
        parts = [torch.stack([v.sum(dtype=torch.int32) for v in self.views])] if self.views else []
        parts += [bits_view(torch.stack(xs)).to(torch.int32) for _, xs in self.scalars]
        # Adam's ``step`` counters live on the CPU while parameters and moments are on the
        # GPU (seen on an H200: torch.cat refused the mix): gather on the host, one copy each.
        vals = torch.cat([p.to("cpu", torch.int64) for p in parts]) if len(parts) > 1 else parts[0].to("cpu", torch.int64)
        if self.identity:
            return vals
        out = torch.empty_like(vals)
        out[self.order] = vals
        return out


class AtRest:
    """One record of ``kind``: bit-sums of named tensors taken after ``step``.

    :meth:`record` after the write; :meth:`verify` before the next use returns
    a suspicion per tensor whose bit-sum moved (harmless when only bit 0 or 1
    of one element can explain it). The record is single-use: verify clears it.
    The :class:`BitSums` plan is kept across steps while the tensors stay the same.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.step: int | None = None
        self.names: list[str] = []
        self.bits = torch.zeros(0, dtype=torch.int64)
        self._plan: BitSums | None = None

    def _sums(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if self._plan is None or not self._plan.same(tensors):
            self._plan = BitSums(tensors)
        return self._plan()

    def record(self, step: int, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.step, self.names = step, [n for n, _ in named]
        self.bits = self._sums([t for _, t in named])

    def clear(self) -> None:
        self.step, self.names = None, []

    def verify(self, step: int, tensors: Sequence[torch.Tensor], rank: int, device: str) -> list[Suspicion]:
        """``tensors`` in the order of the recorded names; forgets the record."""
        if self.step is None:
            return []
        rec_step, names, old = self.step, self.names, self.bits
        self.clear()
        if len(tensors) != len(names):   # the set of tensors changed under us: every one is suspect
            return [Suspicion(step=step, rank=rank, kind=self.kind, tensor="*", device=device,
                              evidence={"hashed_after_step": rec_step, "recorded": len(names), "now": len(tensors)})]
        now = self._sums(tensors)
        out = []
        for i in torch.nonzero(now != old).flatten().tolist():
            delta, harmless = at_rest_delta(int(now[i]) - int(old[i]))
            out.append(Suspicion(step=step, rank=rank, kind=self.kind, tensor=names[i], device=device,
                                 harmless=harmless, evidence={"hashed_after_step": rec_step, "bitsum_delta": delta}))
        return out


class Resting:
    """What the optimizer step writes and nothing may touch until it runs again:
    the parameters and the watched optimizers' state, one :class:`AtRest` each."""

    def __init__(self):
        self.params = AtRest(KIND_AT_REST)
        self.state = AtRest(KIND_STATE_AT_REST)
        self.optimizers: list = []

    def state_tensors(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """(``param.key``, tensor) of every watched optimizer's state, in parameter order."""
        out = []
        for opt in self.optimizers:
            state = opt.state
            for n, p in named_params:
                for k, v in state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out.append((f"{n}.{k}", v))
        return out

    def record(self, step: int, named_params: Sequence[tuple[str, torch.Tensor]], *, params: bool,
               state: bool) -> None:
        """Hash what the optimizer step of ``step`` just wrote (the parts that are due)."""
        if state and self.optimizers:
            self.state.record(step, self.state_tensors(named_params))
        if params:
            self.params.record(step, named_params)

    def verify(self, step: int, named_params: Sequence[tuple[str, torch.Tensor]], rank: int,
               device: str) -> tuple[list[Suspicion], int | None]:
        """Check (and forget) the records: (suspicions, the step the parameters were hashed after, or None)."""
        rec = self.params.step
        out = self.params.verify(step, [p for _, p in named_params], rank, device)
        if self.state.step is not None:
            out += self.state.verify(step, [t for _, t in self.state_tensors(named_params)], rank, device)
        return out, rec

    def clear(self) -> None:
        self.params.clear()
        self.state.clear()
