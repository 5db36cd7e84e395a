"""Activation range checks: each block's output against its own history.

A flipped exponent bit in an activation computed by anything but a checksummed
GEMM (:mod:`.abft`) — attention's matmuls and softmax, a norm, a nonlinearity,
a residual add — changes one element by a power of two, up to ~2¹²⁸. The
loss barely moves (one element of one token) and the gradient norm may stay
inside its spike band, so the loss and gradient checks miss it; the block's
largest magnitude does not: it jumps by that power of two.

Per watched module and step, one number: ``amax``, the largest magnitude of
the module's output (``‖·‖∞``, which propagates NaN, so a non-finite element
shows as a non-finite amax). A non-finite amax is a ``nonfinite`` suspicion;
``log(amax)`` beyond median ± k·MAD of the module's own recent window
(:class:`~.checksums.RobustSpike`, as the gradient spike check, with the same
0.1 floor on the spread of a log-scale series) is an ``activation_spike``: two-sided,
a drop as well as a rise (an exponent-down flip or a sign-and-shrink of the largest
element lowers amax; with k = 50 and the 0.1 floor that is a factor of e⁵ ≈ 150 either
way). Both are handled by replay: a different answer on replay is a transient fault.

Watched: the blocks (the elements of every ``nn.ModuleList`` /
``nn.ModuleDict`` / ``nn.Sequential`` of the model) and each block's direct
children (attention, feed-forward, norms). One reduction per module output on
the device, one host copy per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from resilient.sdc.api import KIND_ACTIVATION_SPIKE, KIND_NONFINITE, Suspicion
from resilient.sdc.checksums import RobustSpike, local

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def watched_modules(named_modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks (elements of containers) and their direct children, each once, in model order."""
    by_name = dict(named_modules)
    chosen: dict[int, tuple[str, nn.Module]] = {}
    for name, m in named_modules:
        if not isinstance(m, CONTAINERS):
            continue
        for child_name, block in m.named_children():
            block_name = f"{name}.{child_name}" if name else child_name
            if by_name.get(block_name) is not block:
                continue
            chosen.setdefault(id(block), (block_name, block))
            for sub_name, sub in block.named_children():
                chosen.setdefault(id(sub), (f"{block_name}.{sub_name}", sub))
    return list(chosen.values())


def _first_tensor(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return None


@dataclass
class ActivationCheck:
    """Range checks of the outputs of :func:`watched_modules` (see the module docstring)."""

    k: float
    window: int = 50
    warmup: int = 10
    names: list[str] = field(default_factory=list)
    armed: bool = False
    _values: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    _spikes: dict[str, RobustSpike] = field(default_factory=dict)
    _handles: list = field(default_factory=list)

    def arm(self, on: bool) -> None:
        self.armed = on
        self._values.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str, out) -> None:
        if not (self.armed and torch.is_grad_enabled()):
            return None
        t = _first_tensor(out)
        if t is not None and t.is_floating_point() and local(t).numel():
            self._values.append((name, torch.linalg.vector_norm(local(t).detach(), math.inf)))
        return None

    def collect(self, step: int, rank: int, judge: bool) -> list[Suspicion]:
        """Suspicions of this rank's watched outputs since the last collect. ``judge``: also
        hold them against their history (and add the clean ones to it); off on a replay."""
        values, self._values = self._values, []
        if not values:
            return []
        amax: dict[str, float] = {}
        for (name, _), v in zip(values, torch.stack([v.to(torch.float64) for _, v in values]).cpu().tolist()):
            amax[name] = v if math.isnan(v) or name not in amax else max(amax[name], v)   # several calls: the largest
        out = []
        for name, a in amax.items():
            if not math.isfinite(a):
                out.append(Suspicion(step=step, rank=rank, kind=KIND_NONFINITE, tensor=name + ".output",
                                     evidence={"where": "activation", "amax": a}))
            elif judge and self.k > 0 and a > 0:
                det = self._spikes.setdefault(name, RobustSpike(self.k, self.window, self.warmup, min_sigma=0.1,
                                                                         two_sided=True))
                spike, z = det.check(math.log(a))
                if spike:
                    out.append(Suspicion(step=step, rank=rank, kind=KIND_ACTIVATION_SPIKE, tensor=name + ".output",
                                         evidence={"amax": a, "log_amax": math.log(a), "robust_z": z}))
        return out


def attach_activation_checks(named_modules: list[tuple[str, nn.Module]], k: float, window: int,
                             warmup: int) -> ActivationCheck:
    chk = ActivationCheck(k=k, window=window, warmup=warmup)
    for name, m in watched_modules(named_modules):
        # prepend: see the output before other hooks (tensor-parallel redistribution, FSDP2's) take it over
        chk._handles.append(m.register_forward_hook(lambda _m, _a, o, nm=name: chk._hook(nm, o), prepend=True))
        chk.names.append(name)
    return chk


def reached_the_step(sus: list[Suspicion]) -> list[Suspicion]:
    """``sus`` without its non-finite activations when nothing else is wrong in the step.

    A non-finite value a module computed in training reaches the loss, and through
    backward every gradient before it, so other checks (non-finite loss, gradients,
    reductions) fire in the same step on some rank; the activation suspicion then says
    where it arose. Alone, it came from a forward whose result the step never used:
    torch.distributed.pipelining's metadata inference runs each stage once on
    uninitialized ``torch.empty`` inputs at a schedule's first step (seen on the 3D
    layout: NaN attention outputs on the second stage, loss and gradients clean), or a
    value masked out before the loss. Either way training is untouched. The list is the
    agreed one (identical on every rank), so every rank decides alike."""
    act = [s for s in sus if s.kind == KIND_NONFINITE and s.evidence.get("where") == "activation"]
    if act and len(act) == len(sus):
        return []
    return sus
