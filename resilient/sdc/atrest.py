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

from resilient.sdc import native
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


BLOCK = 1 << 16   # elements per bit-sum of a packed run: where in it a change is


class BitSums:
    """The bit-sums of a fixed list of tensors, computed again and again.

    On CPU every reduction kernel costs a few microseconds of dispatch whatever
    its size, and a model has hundreds of small state tensors, so the plan is
    built once per list:

    * tensors that tile one storage back to back (optimizer state packed by
      :func:`resilient.optim_state.pack_state`) are one *run*: one kernel gives the
      bit-sums of its pieces, cut at every :data:`BLOCK` elements and at every
      tensor's boundary (0.30 vs 1.15 ms for Adam's 870k moments of the demo,
      measured in the training step), so each entry covers one tensor and a
      suspicion names the tensor struck, not the first of a block's neighbours
      (an ``exp_avg_sq`` flip was reported as the ``exp_avg`` of the parameter
      before it);
    * any other tensor is its own entry, through a cached integer view;
    * 0-dim tensors (Adam's ``step`` counters) take one stack per dtype, their
      bit-sum being their bit pattern.

    :meth:`__call__` returns one int64 per entry, everything leaving the device
    in one copy; :attr:`entries` says which tensors (indices into the list) each
    entry covers: one for a lone tensor, those overlapping the block for a run.
    Valid while the tensors are updated in place (the optimizer does);
    :meth:`same` tells.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.sources = list(tensors)
        xs = [local(t).detach() for t in self.sources]
        self.big = [i for i, x in enumerate(xs) if x.dim()]
        self.ptrs = [x.data_ptr() for x in xs]
        self.entries: list[tuple[int, ...]] = []
        self.parts: list[tuple[str, object]] = []   # ("one", integer view) | ("pieces", (run's view, cuts))
        segs = []                                            # each entry's elements, for the native kernel
        for run in _runs([(i, xs[i]) for i in self.big]):
            if len(run) == 1:
                i = run[0]
                self.parts.append(("one", bits_view(xs[i])))
                self.entries.append((i,))
                segs.append(xs[i])
                continue
            first = xs[run[0]]
            n = sum(xs[i].numel() for i in run)
            flat = bits_view(first.as_strided((n,), (1,), first.storage_offset()))
            cuts, off = [], 0   # (start, end) of each piece: a tensor's part of a block
            for i in run:
                lo, hi = off, off + xs[i].numel()
                off = hi
                a = lo
                while a < hi:
                    b = min(hi, (a // BLOCK + 1) * BLOCK)
                    cuts.append((a, b))
                    self.entries.append((i,))
                    segs.append(flat[a:b])
                    a = b
            self.parts.append(("pieces", (flat, cuts)))
        scalars: dict[torch.dtype, list[int]] = {}
        for i, x in enumerate(xs):
            if not x.dim():
                scalars.setdefault(x.dtype, []).append(i)
        self.scalars = [(idx, [xs[i] for i in idx]) for idx in scalars.values()]
        self.entries += [(i,) for idx, _ in self.scalars for i in idx]
        segs += [x for _, group in self.scalars for x in group]
        # CPU, 4-byte elements (fp32 training): every entry in one C call (see native.py)
        self.native = native.Segments(segs)

    def same(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Still the same tensors, with the same local storage?"""
        return (len(tensors) == len(self.sources) and all(a is b for a, b in zip(tensors, self.sources))
                and all(local(t).data_ptr() == p for t, p in zip(self.sources, self.ptrs)))

    def __call__(self) -> torch.Tensor:
        if not self.sources:
            return torch.zeros(0, dtype=torch.int64)
        if self.native.ok:
            return self.native()
        sums = []
        for how, v in self.parts:
            if how == "one":
                sums.append(v.sum(dtype=torch.int32).reshape(1))
                continue
            flat, cuts = v   # every piece's sum from one running sum (no compiler: the slow path)
            run = torch.cat([torch.zeros(1, dtype=torch.int64, device=flat.device), flat.to(torch.int64).cumsum(0)])
            ends = torch.tensor([b for _, b in cuts], device=flat.device)
            starts = torch.tensor([a for a, _ in cuts], device=flat.device)
            sums.append(((run[ends] - run[starts] + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32))
        parts = [torch.cat(sums)] if sums else []
        parts += [bits_view(torch.stack(xs)).to(torch.int32) for _, xs in self.scalars]
        # Adam's ``step`` counters live on the CPU while parameters and moments are on the
        # GPU (seen on an H200: torch.cat refused the mix): gather on the host, one copy each.
        return torch.cat([p.to("cpu", torch.int64) for p in parts]) if len(parts) > 1 else parts[0].to("cpu", torch.int64)


def _runs(items: list[tuple[int, torch.Tensor]]) -> list[list[int]]:
    """Indices grouped into runs of contiguous tensors that follow each other in one
    storage (same dtype), in storage order (the list's order, e.g. model order, need
    not be the packing's); everything else alone."""
    runs: list[list[int]] = []
    prev = None
    for i, x in sorted(items, key=lambda it: (it[1].untyped_storage().data_ptr(), it[1].storage_offset())):
        key = (x.untyped_storage().data_ptr(), x.dtype, x.device)
        if (prev is not None and x.is_contiguous() and prev[0] == key
                and x.storage_offset() == prev[1]):
            runs[-1].append(i)
        else:
            runs.append([i])
        prev = (key, x.storage_offset() + x.numel()) if x.is_contiguous() else None
    return runs


class AtRest:
    """One record of ``kind``: bit-sums of named tensors taken after ``step``.

    :meth:`record` after the write; :meth:`verify` before the next use returns
    a suspicion per tensor (per set of tensors, for a block of a packed run)
    whose bit-sum moved (harmless when only bit 0 or 1 of one element can
    explain it). The record is single-use: verify clears it.
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
        if now.shape != old.shape:   # laid out anew since the record (not by a restore, which clears it)
            return [Suspicion(step=step, rank=rank, kind=self.kind, tensor="*", device=device,
                              evidence={"hashed_after_step": rec_step, "entries": [len(old), len(now)]})]
        # One suspicion per tensor: the pieces of one big tensor share its name, and
        # the monitor merges suspicions by name, so two changed blocks (a harmless bit-0
        # flip and a real one) must not be reported apart. Harmless only when one entry
        # moved, by what one flip of bit 0 or 1 explains.
        moved: dict[tuple[int, ...], list[int]] = {}
        for i in torch.nonzero(now != old).flatten().tolist():
            moved.setdefault(self._plan.entries[i], []).append(at_rest_delta(int(now[i]) - int(old[i]))[0])
        out = []
        for covers, deltas in sorted(moved.items()):   # in the order of the names
            harmless = len(deltas) == 1 and at_rest_delta(deltas[0])[1]
            out.append(Suspicion(step=step, rank=rank, kind=self.kind, tensor=_names(names, covers), device=device,
                                 harmless=harmless,
                                 evidence={"hashed_after_step": rec_step,
                                           "bitsum_delta": deltas[0] if len(deltas) == 1 else deltas,
                                           **({"tensors": len(covers)} if len(covers) > 1 else {})}))
        return out


def _names(names: list[str], covers: tuple[int, ...], most: int = 3) -> str:
    """The tensors an entry covers, for an event: a block of a packed run may span
    hundreds of small ones (norms' moments)."""
    shown = " | ".join(names[j] for j in covers[:most])
    return shown if len(covers) <= most else f"{shown} | ... ({len(covers) - most} more)"


class Resting:
    """What the optimizer step writes and nothing may touch until it runs again:
    the parameters and the watched optimizers' state, one :class:`AtRest` each."""

    def __init__(self):
        self.params = AtRest(KIND_AT_REST)
        self.state = AtRest(KIND_STATE_AT_REST)
        self.optimizers: list = []
        self._slots: tuple | None = None   # (named_params, [(opt.state, its size)], [(state dict, key, name)])

    def state_tensors(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """(``param.key``, tensor) of every watched optimizer's state, in parameter order.

        The walk over parameters and state dicts (and the names) is kept while the
        parameter list and each optimizer's state mapping are the same objects of the
        same size (``load_state_dict`` installs a new mapping; Adam's first step fills
        it): it runs twice a step. The tensors are read afresh each time."""
        maps = [(opt.state, len(opt.state)) for opt in self.optimizers]
        slots = self._slots
        if (slots is None or slots[0] is not named_params or len(slots[1]) != len(maps)
                or any(a is not b or m != n for (a, m), (b, n) in zip(slots[1], maps))):
            walk = []
            for opt in self.optimizers:
                for n, p in named_params:
                    st = opt.state.get(p)
                    if st:
                        walk += [(st, k, f"{n}.{k}") for k, v in st.items() if isinstance(v, torch.Tensor)]
            slots = self._slots = (named_params, maps, walk)
        out = []
        for st, k, name in slots[2]:
            v = st.get(k)
            if not isinstance(v, torch.Tensor):   # an entry changed kind under us: walk again
                self._slots = None
                return self.state_tensors(named_params)
            out.append((name, v))
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
        """Check (and forget) the records: (suspicions, the step they were hashed after, or None).
        With parameter checks off that is the optimizer state's record: a rollback can then
        still go back to the last step whose state held, not to the initial state."""
        rec = self.params.step if self.params.step is not None else self.state.step
        out = self.params.verify(step, [p for _, p in named_params], rank, device)
        if self.state.step is not None:
            out += self.state.verify(step, [t for _, t in self.state_tensors(named_params)], rank, device)
        return out, rec

    def clear(self) -> None:
        self.params.clear()
        self.state.clear()
