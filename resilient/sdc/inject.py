"""Bit-flip injection: the fault model of silent data corruption, on demand.

A :class:`FlipSpec` names one bit of one element of one tensor on one rank at
one step; :class:`BitFlipInjector` applies it at the loop's hook points. The
chaos harness builds the same spec from a scenario file, so tests and chaos
campaigns inject identical faults. Flips happen in place on the rank-local
storage (a DTensor's ``_local_tensor``), through an integer view of the bytes,
so they are exact: bit 31 of fp32 / 15 of bf16 is the sign, 30..23 / 14..7 the
exponent, the rest the mantissa (bit 0 the lowest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from resilient.sdc.api import SdcError
from resilient.sdc.checksums import bits_view, local

TARGETS = ("grad", "param", "optim_state", "activation", "activation_grad", "weight_grad")
# targets that strike inside forward or backward, from hooks :meth:`BitFlipInjector.attach` installs
HOOKED = ("activation", "activation_grad", "weight_grad")
MODULE_TARGETS = ("activation", "activation_grad")   # ``tensor`` names a module, not a parameter


@dataclass
class FlipSpec:
    """Which bit to flip, where, and when.

    ``tensor`` is a parameter name as ``model.named_parameters()`` gives it
    (for ``activation``: a module name as ``named_modules()`` gives it; the flip
    hits that module's output in forward; for ``activation_grad``: a module name,
    the flip hits the gradient its backward hands to its input: for a Linear, the
    result of its grad-input GEMM). ``weight_grad`` names a parameter and hits
    its gradient as the backward computes it (for a Linear's weight: the result
    of its grad-weight GEMM), before any other hook or reduction sees it; not for
    FSDP2-sharded parameters, whose gradient the backward computes on an unsharded
    copy. ``grad``, by contrast, hits the finished gradient after backward.
    ``element`` indexes the *rank-local* flattened
    tensor (the local shard of a DTensor); negative counts from the end.
    ``persistent`` flips at every call from ``step`` on, replays included
    (a bad device); otherwise once (a transient fault), and not again on replay.

    Where: ``rank`` (a global rank) by default. A bad *device* keeps computing
    wrong answers whichever rank the job gives it, and the rank it held goes to
    whoever replaces it: give ``node`` (the agent's ``--node-id``) and
    ``local_rank`` to pin the fault to hardware instead; ``rank`` is then
    ignored. That is the fault model of quarantine: the spare that takes the
    rank over computes right.
    """

    target: str
    tensor: str
    bit: int
    rank: int = 0
    step: int = 0
    element: int = 0
    persistent: bool = False
    state_key: str = "exp_avg"   # optimizer state entry for target="optim_state"
    node: str = ""               # pin to a device: this node's ...
    local_rank: int = 0          # ... local rank (only with ``node``)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise SdcError(f"FlipSpec.target={self.target!r}; use one of {TARGETS}")
        for key, kind, least in (("tensor", str, None), ("bit", int, 0), ("rank", int, 0), ("step", int, 0),
                                 ("element", int, None), ("persistent", bool, None), ("state_key", str, None),
                                 ("node", str, None), ("local_rank", int, 0)):
            value = getattr(self, key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise SdcError(f"FlipSpec.{key}={value!r}: expected {kind.__name__}")
            if least is not None and value < least:
                raise SdcError(f"FlipSpec.{key}={value!r}: must be ≥ {least}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FlipSpec":
        known = set(cls.__dataclass_fields__)
        bad = set(d) - known
        if bad:
            raise SdcError(f"unknown FlipSpec keys {sorted(bad)}; known: {sorted(known)}")
        missing = [k for k in ("target", "tensor", "bit") if k not in d]
        if missing:
            raise SdcError(f"sdc.inject entry {d} lacks {missing}: give at least target, tensor and bit")
        return cls(**d)


def flip_bit(t: torch.Tensor, element: int, bit: int) -> tuple[float, float]:
    """Flip ``bit`` of flat ``element`` of ``t`` (or its local shard) in place.

    Returns (old value, new value). Raises :class:`SdcError` for an element
    outside the local shard or a bit outside the dtype.
    """
    x = local(t)
    width = x.element_size() * 8
    if not 0 <= bit < width:
        raise SdcError(f"bit {bit} outside 0..{width - 1} for {x.dtype}")
    n = x.numel()
    if not -n <= element < n:
        raise SdcError(f"element {element} outside the local tensor of {n} elements (shape {tuple(x.shape)})")
    if not x.is_contiguous():
        raise SdcError("flip_bit needs a contiguous local tensor")
    flat = x.detach().view(-1)
    ints = bits_view(flat)
    with torch.no_grad():
        old = float(flat[element])
        mask = torch.tensor(1, dtype=ints.dtype) << bit if bit < width - 1 else torch.tensor(torch.iinfo(ints.dtype).min, dtype=ints.dtype)
        ints[element] ^= mask.to(ints.device)
        new = float(flat[element])
    return old, new


class StrikeRecord:
    """Where a transient flip notes that it struck, so that it strikes once per *run*.

    The injector's own memory dies with its worker: a worker killed and restarted (or a
    rollback that relaunches the job) would meet the flip's step again and strike again,
    turning a campaign's one fault into several. One empty file per flip under
    ``<run dir>/sdc-strikes`` (the run dir is the job's alone, 0700; the directory 0700,
    the file 0600, made with ``O_EXCL``) survives the worker; its name is the flip's index
    in ``sdc.inject`` and a digest of its fields, so a changed spec is a new flip."""

    def __init__(self, directory: str | os.PathLike, index: int, spec: "FlipSpec"):
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
        self.directory = Path(directory)
        self.path = self.directory / f"{index}-{digest}"

    def struck(self) -> bool:
        return self.path.exists()

    def note(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            pass


class BitFlipInjector:
    """Applies a :class:`FlipSpec` on its rank; a no-op elsewhere.

    Call :meth:`maybe_inject` at the point that matches the target: after
    backward for ``grad``, after the optimizer step for ``param`` and
    ``optim_state``; ``activation`` flips fire from a forward hook installed by
    :meth:`attach` (the forward of step ``self.current_step``). ``log`` gets one
    dict per flip (the chaos harness turns them into ``fault_injected`` events).
    ``record``: where a transient flip notes its strike for the whole run
    (:class:`StrikeRecord`); without one it strikes once per injector.
    """

    def __init__(self, spec: FlipSpec, rank: int, log: Callable[[dict], None] | None = None,
                 node: str = "", local_rank: int = 0, record: StrikeRecord | None = None):
        self.spec, self.rank, self.log = spec, rank, log
        self.node, self.local_rank = node, local_rank
        self.record = record
        self.fired = 0
        self.current_step = -1
        self._handle = None

    def here(self) -> bool:
        """Is the faulty device (or rank) the one this injector runs on?"""
        if self.spec.node:
            return (self.node, self.local_rank) == (self.spec.node, self.spec.local_rank)
        return self.rank == self.spec.rank

    def _due(self, step: int) -> bool:
        if not self.here():
            return False
        if self.spec.persistent:
            return step >= self.spec.step
        return step == self.spec.step and self.fired == 0 and not (self.record is not None and self.record.struck())

    def _flip(self, t: torch.Tensor, step: int, what: str) -> dict:
        if self.record is not None and not self.spec.persistent:
            self.record.note()   # before the flip: a worker killed right after it must not strike again
        old, new = flip_bit(t, self.spec.element, self.spec.bit)
        self.fired += 1
        rec = {"fault": "bitflip", "target": self.spec.target, "tensor": what, "bit": self.spec.bit,
               "element": self.spec.element, "step": step, "rank": self.rank, "old": old, "new": new,
               **({"device": f"{self.node}:{self.local_rank}"} if self.spec.node else {})}
        if self.log:
            self.log(rec)
        return rec

    def maybe_inject(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict | None:
        """Flip now if the spec is due at ``step`` on this rank; returns the flip record."""
        self.current_step = step
        if self.spec.target in HOOKED or not self._due(step):
            return None
        params = dict(model.named_parameters())
        if self.spec.tensor not in params:
            raise SdcError(f"no parameter {self.spec.tensor!r}; names: {sorted(params)[:8]}...")
        p = params[self.spec.tensor]
        if self.spec.target == "param":
            return self._flip(p, step, self.spec.tensor)
        if self.spec.target == "grad":
            if p.grad is None:
                raise SdcError(f"{self.spec.tensor!r} has no gradient at step {step}; inject after backward")
            return self._flip(p.grad, step, self.spec.tensor + ".grad")
        if optimizer is None or p not in optimizer.state or self.spec.state_key not in optimizer.state[p]:
            raise SdcError(f"no optimizer state {self.spec.state_key!r} for {self.spec.tensor!r} (after the first step?)")
        return self._flip(optimizer.state[p][self.spec.state_key], step, f"{self.spec.tensor}.{self.spec.state_key}")

    def validate(self, parts: Sequence[nn.Module], world: int) -> None:
        """Refuse at start-up what would fail (or do nothing) at the injection step: a
        rank outside the job, a tensor this rank does not hold, a bit or element outside it."""
        if not self.spec.node and self.spec.rank >= world:
            raise SdcError(f"sdc.inject: rank {self.spec.rank} is outside the job's {world} ranks")
        if not self.here() or self.spec.target in MODULE_TARGETS:
            return  # modules: checked when the hook is attached
        params = {n: p for m in parts for n, p in m.named_parameters()}
        if self.spec.tensor not in params:
            raise SdcError(f"sdc.inject: rank {self.rank} holds no parameter {self.spec.tensor!r}; "
                           f"names: {sorted(params)[:6]}...")
        if self.spec.target == "weight_grad" and hasattr(params[self.spec.tensor], "placements"):
            raise SdcError(f"sdc.inject: target='weight_grad' needs an unsharded parameter; {self.spec.tensor!r} "
                           "is a DTensor (FSDP2 / tensor parallel): use target='activation_grad' on its module")
        x = local(params[self.spec.tensor])
        if self.spec.bit >= x.element_size() * 8 or not -x.numel() <= self.spec.element < x.numel():
            raise SdcError(f"sdc.inject: bit {self.spec.bit} / element {self.spec.element} outside "
                           f"{self.spec.tensor!r} on rank {self.rank} ({x.dtype}, {x.numel()} local elements)")

    def attach(self, model: nn.Module) -> None:
        """Install the hook of a forward or backward target (:data:`HOOKED`; idempotent).
        Attach before the SDC compute checks first run, so a backward flip strikes before
        their gradient hooks see the value (a tensor's hooks run in the order registered)."""
        if self.spec.target not in HOOKED or self._handle is not None:
            return
        if self.spec.target == "weight_grad":
            params = dict(model.named_parameters())
            if self.spec.tensor not in params:
                raise SdcError(f"no parameter {self.spec.tensor!r} for a weight_grad flip")
            self._handle = params[self.spec.tensor].register_hook(
                lambda g: self._flipped(g, self.spec.tensor + ".grad(backward)"))
            return
        mods = dict(model.named_modules())
        if self.spec.tensor not in mods:
            raise SdcError(f"no module {self.spec.tensor!r} for an {self.spec.target} flip")
        module = mods[self.spec.tensor]
        if self.spec.target == "activation_grad":
            def bw_hook(_m, grad_input, _grad_output):
                if not grad_input or grad_input[0] is None:   # the module's input needs no gradient
                    return None
                flipped = self._flipped(grad_input[0], self.spec.tensor + ".grad_input")
                return None if flipped is None else (flipped,) + tuple(grad_input[1:])
            self._handle = module.register_full_backward_hook(bw_hook)
            return

        # prepend: the flip strikes before the module's other forward hooks see its output (the
        # SDC compute checks, a tensor-parallel redistribution), as a fault in the module would
        self._handle = module.register_forward_hook(
            lambda _m, _inp, out: self._flipped(out, self.spec.tensor + ".output") if isinstance(out, torch.Tensor) else None,
            prepend=True)

    def _flipped(self, t: torch.Tensor, what: str) -> torch.Tensor | None:
        """A copy of ``t`` with the spec's bit flipped if due now (else ``None``: unchanged)."""
        if not self._due(self.current_step):
            return None
        t = t.clone()
        self._flip(t, self.current_step, what)
        return t

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
