"""Checksummed GEMMs (algorithm-based fault tolerance) for ``nn.Linear`` layers.

A device whose arithmetic unit computes a wrong product gives a wrong forward
or backward answer that no check of what travels (reductions, replicas) or
rests (parameters, optimizer state) can see. Each of the three GEMMs of a
Linear layer (``W``: ``[N, K]``, ``X``: ``[M, K]`` flattened over the leading
dimensions) obeys a linear identity that costs matrix-vector products only:

* forward     ``Y  = X Wᵀ (+ b)``:  ``Y·1  = X (Wᵀ·1) (+ (b·1)·1)``  (M rows)
* grad-input  ``dX = dY W``:        ``dX·1 = dY (W·1)``              (M rows)
* grad-weight ``dW = dYᵀ X``:       ``dW·1 = dYᵀ (X·1)``             (N rows)

Both sides are computed in the model's dtype (half types in float32) from the
tensors the GEMM read and wrote, with matrix-vector products only; on CPU in
float32, by fused kernels that read each operand once (``native.c``: 1.30-1.32x a
plain step at the demo's size, against 1.51-1.61x with torch's kernels and 2.4x
with float64 copies);
a row whose sides differ by more than rounding can explain is a
``gemm_mismatch`` suspicion on this rank, handled like any other by replay —
unless the excess is no more than a flip of the lowest two bits of the
output's largest element would make (``4·u_out·amax``, the at-rest checks'
:func:`~.checksums.harmless_bound`): then it is reported ``harmless`` and not
acted on, as a rounding-sized change cannot matter to training.

The grad-weight identity pairs the ``dY`` of each use with the weight
gradient of the same backward pass (autograd's graph-task id): a backward
that computes input gradients only (``torch.autograd.grad`` over the inputs,
as torch.distributed.pipelining's metadata inference and its zero-bubble
schedules' input-only pass do) leaves no stale use behind to be summed into a
later pass's weight gradient.

The rounding bound of a row (Higham, any summation order): each output element
of an inner product of length ``n`` accumulated with unit roundoff ``u_acc`` is
within ``γ_n(u_acc)·Σ|a||b|`` of the exact value, plus ``u_out·|y|`` for the
final rounding to the output dtype, plus the absolute error of rounding below
the normal range (:func:`underflow`); summed over the row's elements, and the
check's own arithmetic adds its roundings in its dtype (:meth:`GemmCheck._record`) on the same
magnitudes. ``Σ|a||b|`` over a row is one more matrix-vector product of the
absolute values. ``u_acc`` follows how torch computes the GEMM: half types
(bfloat16, float16) accumulate in float32, float32 in float32 — with extra
input rounding when ``torch.get_float32_matmul_precision()`` lets float32
GEMMs use TF32 (``high``) or bfloat16 (``medium``) —, float64 in float64. On
CUDA, half-type GEMMs with ``allow_{bf16,fp16}_reduced_precision_reduction``
(torch's default) may round split-K partial sums to the output dtype: modelled
as a pairwise reduction of at most ``⌈log2 n⌉`` levels in ``u_out``. The whole
bound is multiplied by ``sdc.bound_safety`` as the reduction check's is.

Covered: every module whose ``forward`` is ``nn.Linear.forward`` and that is
called as a module (FSDP2's all-gathered weights included: the hooks see the
unsharded plain parameter; a tensor-parallel ``DTensor`` Linear is checked on
its local shard: the local GEMM, before the output redistribution), in float32,
bfloat16, float16 and float64, under autocast too (the check uses the GEMM's
dtype). The grad-weight check needs the weight's gradient per backward: a weight
shared with another module (tied embeddings) gets the forward and grad-input
checks only. Not covered: matmuls outside ``nn.Linear`` modules (attention's
``scaled_dot_product_attention``, ``nn.MultiheadAttention``'s projections,
which it calls through ``F.linear`` without the module), convolutions,
embeddings, subclasses that override ``forward`` (LoRA), forward passes without
gradients (evaluation), a tensor-parallel Linear with a bias that is not
sharded like its output.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from resilient.sdc import native
from resilient.sdc.api import KIND_GEMM, Spent, Suspicion
from resilient.sdc.checksums import gamma, local, unit_roundoff
from resilient.sdc.parts import _timed

_U64 = 2.0 ** -53
_MATMUL_INPUT_U = {"highest": 0.0, "high": 2.0 ** -11, "medium": 2.0 ** -8}   # tf32 / bf16 inputs
GEMMS = ("forward", "grad_input", "grad_weight")


def rounding_coefficients(dtype: torch.dtype, inner: int, device: torch.device) -> tuple[float, float]:
    """(coefficient of Σ|a||b|, coefficient of Σ|y|) of the rounding bound of a GEMM with
    inner dimension ``inner`` and output ``dtype`` on ``device`` (module docstring)."""
    u_out = unit_roundoff(dtype)
    if dtype in (torch.bfloat16, torch.float16):
        coef = gamma(inner, unit_roundoff(torch.float32))
        reduced = (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction if dtype == torch.bfloat16
                   else torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
        if device.type == "cuda" and reduced:
            coef += gamma(max(1, math.ceil(math.log2(max(inner, 2)))), u_out)
    else:
        coef = gamma(inner, u_out)
        if dtype == torch.float32:
            coef += 2 * _MATMUL_INPUT_U.get(torch.get_float32_matmul_precision(), 2.0 ** -8)
    return coef, u_out


def underflow(dtype: torch.dtype, inner: int) -> float:
    """Absolute rounding error of one output element below the normal range, where the
    relative model (``u·|y|``) fails: half the smallest subnormal of the output dtype, plus
    as much for each of the ``inner`` products in the accumulation dtype (a float16 output
    of 1e-8 rounds to 0: off by all of it)."""
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    eta = lambda t: 0.5 * torch.finfo(t).tiny * torch.finfo(t).eps   # noqa: E731
    return eta(dtype) + inner * eta(acc)


@functools.lru_cache(maxsize=4096)
def _bound_terms(dtype: torch.dtype, inner: int, width: int, device: torch.device, precision: str,
                 reduced: object) -> tuple[float, float, float]:
    """(relative coefficient of a row's Σ|a||b|, absolute floor, coefficient of the largest
    output's harmless change) of the rounding bound of a GEMM (:meth:`GemmCheck._record`):
    constants of the GEMM's dtype, sizes and precision settings (``precision``: float32
    matmul precision; ``reduced``: CUDA's reduced-precision reduction flags), computed once."""
    cdt = check_dtype(dtype)
    coef, u_out = rounding_coefficients(dtype, inner, device)
    u_c = unit_roundoff(cdt)
    tf32 = 2 * _MATMUL_INPUT_U.get(precision, 2.0 ** -8) if cdt == torch.float32 else 0.0
    check = 2 * gamma(width + 1, u_c) + gamma(inner + 1, u_c) + tf32
    rel = (coef + u_out * (1 + coef) + check) * (1 + gamma(inner + width + 2, u_c))
    floor = width * underflow(dtype, inner) + (inner + width) * 0.5 * torch.finfo(cdt).tiny
    # what a flip of the lowest two bits of the output's largest element changes (module docstring)
    return rel, floor, 4 * u_out


class _TapGrad(torch.autograd.Function):
    """Identity whose backward hands the incoming gradient to ``fn``: the grad-input of
    exactly one GEMM (the tapped tensor feeds only that Linear)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.fn(g)
        return g, None


@dataclass
class _Pending:
    """The grad-weight identity of one weight, summed over its uses in one backward
    (autograd sums the uses before the weight's hook sees the gradient)."""

    task: int = -1                       # the autograd graph task these uses' dY came from
    expect: torch.Tensor | None = None   # Σ dYᵀ (X·1)   [N], in the check's dtype
    scale: torch.Tensor | None = None    # Σ |dY|ᵀ (|X|·1)
    inner: int = 0                       # Σ M over the uses (+1 per use: the sum of uses)
    dtype: torch.dtype = torch.float32

    def add(self, expect: torch.Tensor, scale: torch.Tensor, inner: int, dtype: torch.dtype) -> None:
        self.expect = expect if self.expect is None else self.expect + expect
        self.scale = scale if self.scale is None else self.scale + scale
        self.counted(inner, dtype)

    def counted(self, inner: int, dtype: torch.dtype) -> None:
        """One more use, its sides already added (in place, by the native kernel)."""
        self.inner += inner + 1
        self.dtype = dtype

    def native_sums(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Float32 ``[n]`` sums for the native kernel to add into (zeros for the first use);
        None when an earlier use of this pass left others (then this one sums in torch)."""
        if self.expect is None:
            self.expect, self.scale = torch.zeros(2, n, dtype=torch.float32).unbind()
        ok = self.expect.dtype == torch.float32 and self.expect.is_contiguous() and self.expect.device.type == "cpu"
        return (self.expect, self.scale) if ok else None


@dataclass
class _Use:
    """What one call of a Linear leaves for its backward checks: row sums only, never X or W."""

    name: str
    dtype: torch.dtype           # the GEMM's dtype
    w_rows: torch.Tensor | None = None       # W·1 [N] (grad-input identity), in the check's dtype
    w_abs_rows: torch.Tensor | None = None   # |W|·1
    x_rows: torch.Tensor | None = None       # X·1 [M] (grad-weight identity)
    x_abs_rows: torch.Tensor | None = None   # |X|·1
    expect_dx: torch.Tensor | None = None
    scale_dx: torch.Tensor | None = None


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the identities are evaluated in: the model's own (float32, float64); half
    types in float32, as their GEMMs accumulate (their own precision would drown a flip)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


@dataclass
class GemmCheck:
    """The checks of the Linear layers of some modules (:func:`attach_abft`).

    Armed for a step (``arm``), every training forward and backward of a covered
    Linear records one worst-row ratio ``|Δ| / bound`` per GEMM as a device scalar
    (no host synchronisation inside the step); :meth:`collect` moves them to the
    host in one copy and turns ratios above 1 into suspicions."""

    safety: float = 2.0
    covered: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)   # name -> why not covered
    armed: bool = False
    max_clean_ratio: float = 0.0   # the largest |Δ| / bound of a passing GEMM so far: the margin of the bound
    _results: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)
    _pending: dict[int, _Pending] = field(default_factory=dict)   # id(weight) -> one backward pass's uses
    _hooked: dict[int, object] = field(default_factory=dict)      # id(weight) -> grad hook handle
    _handles: list = field(default_factory=list)
    _spent: Spent = field(default_factory=Spent)   # in the hooks and collect: what a sampled step's checks cost

    @property
    def spent(self) -> Spent:
        return self._spent

    def arm(self, on: bool) -> None:
        self.armed = on
        self._results.clear()
        self._pending.clear()

    def close(self) -> None:
        for h in self._handles + list(self._hooked.values()):
            h.remove()
        self._handles.clear()
        self._hooked.clear()

    # ---- one row-sum identity ------------------------------------------------
    def _record(self, name: str, gemm: str, out: torch.Tensor, expect: torch.Tensor, scale: torch.Tensor,
                inner: int, dtype: torch.dtype) -> None:
        """``out`` (the GEMM's output as ``[rows, width]``, in its dtype ``dtype``), ``expect`` (the
        identity's side) and ``scale`` (Σ|a||b| per row), in the check's dtype.

        The bound (module docstring), with ``S`` the row's ``scale``: the GEMM's own rounding
        ``coef·S + u_out·Σ|y|``, where ``Σ|y| ≤ S(1 + coef)`` (each output is an inner product
        of the row, so no pass over ``|Y|`` is needed), plus the check's own arithmetic in
        its dtype (unit roundoff ``u_c``): the row sum of ``Y`` (``γ_w``), ``W·1`` or ``X·1``
        (``γ_w`` on ``S``), the product with it (``γ_n``) and ``S`` itself, taken with its
        own rounding (``γ_{n+w+2}`` relative); plus the underflow terms."""
        width = out.shape[-1]
        reduced = out.device.type == "cuda" and (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                                                 torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
        rel, floor, harm = _bound_terms(dtype, inner, width, out.device, torch.get_float32_matmul_precision(), reduced)
        if (lib := native.gemm_ready(out, vecs=(expect, scale))) is not None:
            self._results.append((name, gemm, native.gemm_record(lib, out, expect, scale, self.safety * rel,
                                                                 self.safety * floor, harm)))
            return
        got = out.sum(-1, dtype=expect.dtype)
        # (torch.linalg.vector_norm(out, inf) is 10x slower than aminmax on CPU, measured)
        lo, hi = torch.aminmax(out) if out.numel() else (out.new_zeros(()), out.new_zeros(()))
        out_amax = hi.abs().maximum(lo.abs())
        bound = scale * (self.safety * rel) + self.safety * floor
        diff = (got - expect).abs()
        # a non-finite value on either side (an input, an output that overflowed its dtype):
        # the nonfinite checks' case (loss, gradients, activations), not judged here
        ratio = (diff / bound).masked_fill_(~torch.isfinite(diff + bound), 0.0)
        worst = ratio.argmax()
        self._results.append((name, gemm, torch.stack([ratio[worst], diff[worst], bound[worst],
                                                       worst.to(ratio.dtype), harm * out_amax.to(ratio.dtype)]).to(torch.float64)))

    # ---- hooks ---------------------------------------------------------------
    def _pre(self, name: str, module: nn.Module, args: tuple):
        if not (self.armed and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)
                and args[0].requires_grad):
            return None
        use = module._resilient_abft_use = _Use(name, torch.float32)   # filled by _post
        return (_TapGrad.apply(args[0], lambda g: self._grad_input(use, g)),) + tuple(args[1:])

    def _post(self, name: str, module: nn.Module, args: tuple, out: torch.Tensor, check_dw: bool) -> None:
        use = module.__dict__.pop("_resilient_abft_use", None)
        if not (self.armed and torch.is_grad_enabled() and isinstance(out, torch.Tensor)):
            return None
        y = local(out).detach()
        # the identities in the check's dtype, not autocast's (the hook runs inside the region)
        with torch.autocast(y.device.type, enabled=False):
            return self._forward(name, module, local(args[0]).detach(), out, y, use, check_dw)

    @_timed   # from here, not _post: a step whose checks are not armed pays no clock
    def _forward(self, name: str, module: nn.Module, x: torch.Tensor, out: torch.Tensor, y: torch.Tensor,
                 use: _Use | None, check_dw: bool) -> None:
        w, b = module.weight, module.bias
        wl = local(w).detach()
        dtype = y.dtype
        cdt = check_dtype(dtype)
        k, n = wl.shape[1], wl.shape[0]
        x2 = _as(x.reshape(-1, k), cdt)   # a view for float32/64 models: no copy of X
        w2 = _as(wl, cdt)
        y2 = y.reshape(-1, n)
        grads = out.requires_grad
        check_dw = check_dw and grads and w.requires_grad
        # forward: Y·1 = X (Wᵀ·1) + Σb
        if (lib := native.gemm_ready(x2, w2, y2)) is not None:
            # one pass over each of W and X, no |.| copies (native.c)
            w_rows, w_abs_rows, w_cols, w_abs_cols = native.gemm_weight(lib, w2)
            expect, scale, x_rows, x_abs_rows = native.gemm_rows(lib, x2, w_cols, w_abs_cols, check_dw)
        else:
            w_abs, x_abs = w2.abs(), x2.abs()   # the only copies: matrix-vector products do the rest
            # (matrix-vector products: a [K, 2] right side is 10x slower on CPU)
            expect, scale = x2 @ w2.sum(0), x_abs @ w_abs.sum(0)
            w_rows, w_abs_rows = w2.sum(1), w_abs.sum(1)
            x_rows, x_abs_rows = (x2.sum(1), x_abs.sum(1)) if check_dw else (None, None)
        if b is not None:
            b2 = local(b).detach()
            expect = expect + b2.sum(dtype=expect.dtype)
            scale = scale + b2.abs().sum(dtype=expect.dtype)
        self._record(name, "forward", y2, expect, scale, k + (b is not None), dtype)
        if not grads:
            return None
        if use is None:   # X needs no gradient (raw data in): no grad-input GEMM runs
            use = _Use(name, dtype)
        use.dtype, use.w_rows, use.w_abs_rows = dtype, w_rows, w_abs_rows
        if check_dw:
            use.x_rows, use.x_abs_rows = x_rows, x_abs_rows
            if id(w) not in self._hooked:   # FSDP2's unsharded weight is one object for the whole run
                self._hooked[id(w)] = w.register_hook(lambda gw, key=id(w), nm=name: self._grad_weight(key, nm, gw))
        out.register_hook(lambda g: self._grad_output(use, g, w if check_dw else None))
        return None

    @_timed
    def _grad_output(self, use: _Use, g: torch.Tensor, weight: torch.Tensor | None) -> None:
        """dY arrived (before the Linear's backward): the expected sides of both backward identities."""
        n = use.w_rows.numel()
        dy = _as(local(g).detach().reshape(-1, n), check_dtype(use.dtype))
        pending = None
        if weight is not None:
            task = torch._C._current_graph_task_id()
            pending = self._pending.get(id(weight))
            if pending is None or pending.task != task:   # an earlier pass that computed no weight gradient
                pending = self._pending[id(weight)] = _Pending(task=task)
        lib = native.gemm_ready(dy)
        sums = pending.native_sums(n) if lib is not None and pending is not None else None
        if lib is not None and (pending is None or sums is not None):
            # one pass over dY for both identities (native.c)
            xr, xar = (use.x_rows, use.x_abs_rows) if pending is not None else (None, None)
            use.expect_dx, use.scale_dx = native.gemm_dy(lib, dy, use.w_rows, use.w_abs_rows, xr, xar, *(sums or (None, None)))
            if pending is not None:
                pending.counted(use.x_rows.numel(), use.dtype)
            return
        dy_abs = dy.abs()
        wr, war = _as(use.w_rows, dy.dtype), _as(use.w_abs_rows, dy.dtype)
        use.expect_dx, use.scale_dx = dy @ wr, dy_abs @ war
        if pending is not None:
            # dYᵀ·v, not v·dY: a matrix-vector product (the latter runs as a GEMM on CPU)
            xr, xar = _as(use.x_rows, dy.dtype), _as(use.x_abs_rows, dy.dtype)
            pending.add(dy.T @ xr, dy_abs.T @ xar, use.x_rows.numel(), use.dtype)

    @_timed
    def _grad_input(self, use: _Use, g: torch.Tensor) -> None:
        if use.expect_dx is None:
            return
        dx = local(g).detach()
        self._record(use.name, "grad_input", dx.reshape(-1, dx.shape[-1]).to(use.dtype), use.expect_dx, use.scale_dx,
                     use.w_rows.numel(), use.dtype)

    def _grad_weight(self, key: int, name: str, g: torch.Tensor) -> None:
        p = self._pending.pop(key, None)   # the hook stays for the run: most passes record nothing
        if p is None or p.task != torch._C._current_graph_task_id():
            return None
        self._check_grad_weight(name, g, p)
        return None

    @_timed
    def _check_grad_weight(self, name: str, g: torch.Tensor, p: _Pending) -> None:
        self._record(name, "grad_weight", local(g).detach().to(p.dtype), p.expect, p.scale, p.inner, p.dtype)

    # ---- the step's verdict ----------------------------------------------------
    def collect(self, step: int, rank: int) -> list[Suspicion]:
        """This rank's GEMMs since the last collect whose identity failed beyond rounding."""
        results, self._results = self._results, []
        self._pending.clear()
        return self._judge(results, step, rank) if results else []

    @_timed
    def _judge(self, results: list[tuple[str, str, torch.Tensor]], step: int, rank: int) -> list[Suspicion]:
        rows = torch.stack([r for _, _, r in results]).cpu()   # one copy: [n, 5]
        out = []
        for (name, gemm, _), (ratio, diff, bound, row, harm) in zip(results, rows.tolist()):
            if ratio <= 1:
                self.max_clean_ratio = max(self.max_clean_ratio, ratio)
            else:
                out.append(Suspicion(step=step, rank=rank, kind=KIND_GEMM, tensor=f"{name}:{gemm}",
                                     harmless=diff <= bound + harm,
                                     evidence={"row": int(row), "dsum": diff, "bound": bound, "excess": ratio,
                                               "harmless_bound": bound + harm}))
        return out


def _plain_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def attach_abft(named_modules: list[tuple[str, nn.Module]], safety: float, shared: set[int]) -> GemmCheck:
    """Hook every plain ``nn.Linear`` of ``named_modules``; ``shared``: ids of parameters
    held by more than one module (their gradient is not one GEMM's: no grad-weight check)."""
    chk = GemmCheck(safety=safety)
    for name, m in named_modules:
        if not _plain_linear(m):
            continue
        w, b = m.weight, m.bias
        if hasattr(w, "placements") and b is not None and list(getattr(b, "placements", ())) != list(w.placements):
            chk.skipped[name] = "tensor-parallel bias not sharded like the weight's rows"
            continue
        check_dw = id(w) not in shared
        if not check_dw:
            chk.skipped[name + ":grad_weight"] = "weight shared with another module"
        chk._handles.append(m.register_forward_pre_hook(lambda mod, a, nm=name: chk._pre(nm, mod, a)))
        # prepend: before a tensor-parallel output hook redistributes the local GEMM's result
        chk._handles.append(m.register_forward_hook(lambda mod, a, o, nm=name, dw=check_dw: chk._post(nm, mod, a, o, dw),
                                                    prepend=True))
        chk.covered.append(name)
    return chk
