"""The linear check of a reduction: what went in must sum to what came out.

After an FSDP2 reduce-scatter every dp rank holds a *different* shard of the
reduced gradient, so there is no replica to compare with. But a reduction is
linear: for destination rank ``r`` (which receives chunk ``r`` of every rank's
flat input buffer ``x_k``)::

    out_r = scale · Σ_k x_k[r]      ⇒      Σ out_r = scale · Σ_k Σ x_k[r]

Each rank sums its input chunks in float64 *before* the collective (inside a
wrapper around FSDP2's reduce-scatter comm, installed with the public
``FSDPModule.set_custom_reduce_scatter``) and sums its local gradient shards in
float64 *when the loop asks* (after backward, before the optimizer step). One
all_gather of ``2N+3`` numbers per FSDP unit and rank compares the two.

Rounding bound (derived, not tuned). Let ``u`` be the unit roundoff of the
reduce dtype (``2**-24`` fp32, ``2**-8`` bf16) and ``L = Σ_k Σ_i |x_k[r]_i|``
the float64 L1 of what went in. Each output element is produced by at most

* ``N-1`` additions in the collective (any order or tree),
* 1 rounding for the average / pre-/post-divide when ``scale != 1``,
* 1 rounding for the cast to the parameter dtype when the reduce dtype differs
  (we then take ``u`` of the coarser dtype),
* ``c-1`` additions when ``c`` reduce-scatters accumulate into ``.grad``
  (gradient accumulation without ``no_sync``),
* 1 rounding for a scaling of the reduced gradients after the collective
  (``post_scale``, below),

so with ``m`` = their count, Higham's bound for recursive sums gives
``|Σ out_r - scale·Σ in_r| ≤ γ_m(u) · scale · L``, plus the error of the
float64 sums themselves (``γ_n(2**-53)·L`` on each side, n the element count).
The check uses ``bound_safety ×`` this (config: kernels that block or fuse the
sum may round a little more often than the model counts).

Pipeline parallelism. ``torch.distributed.pipelining`` schedules run
backward per micro-batch with gradient sync off (FSDP2 accumulates the
unsharded gradients), reduce-scatter once per stage after the last
micro-batch (``perform_reduce_grad``), and then divide the reduced gradients
by the number of micro-batches (``scale_grads=True``, the default) - *after*
the collective, so what the check reads is ``post_scale · scale · Σ in`` with
``post_scale = 1/n_microbatches`` (:func:`pipeline_post_scale`). Without it
every unit of every pp rank disagreed by exactly that factor: the false alarms
that had SDC switched off for pp > 1. A rank holding several stages
(interleaved schedules) has one FSDP root per stage: one check per stage,
each over that stage's dp group.

Coverage, honestly: the check sees corruption *in* the reduction (a bad link,
a wrong add in the collective) when it moves the sum by more than the bound,
i.e. when ``|Δx| ≳ m·u·L``: sign, exponent and high-mantissa flips of
elements of ordinary size in shards up to ~10⁶ elements (fp32), large elements
beyond that. Anything that changes the reduced gradient shard *after* the
collective (memory, a stray kernel) is caught exactly: the wrapper takes the
output's float64 sum and int32 bit-sum as the collective leaves it (in cache,
one pass each), and the check recomputes only the bit-sum; every single-bit
flip moves it (:mod:`.atrest`). That needs the gradients to *be* the output
buffer (:meth:`_Unit.hashed_output`: one reduction per step, no post-divide,
cast or pipeline scaling after it); otherwise the output sum is taken from the
gradients at check time, under the bound, as before. It does *not*
see a wrong gradient computed by backward *before* the reduction (the wrong
value goes in and comes out consistently); those are caught only when they are
non-finite or move the rank's pre-reduction L1 out of its window (a per-rank
robust spike test on the numbers this check collects anyway), or by replay.
HSDP (a second all-reduce) is not covered: :func:`attach_fsdp` refuses it.
Gradients must be zero or ``None`` before each step's first backward
(``optimizer.zero_grad()``): pre-existing gradient mass is not in any input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from resilient.sdc import native
from resilient.sdc.api import (KIND_GRAD_AT_REST, KIND_GRAD_SPIKE, KIND_NONFINITE, KIND_REDUCTION, SdcError, Spent,
                               Suspicion)
from resilient.sdc.atrest import at_rest_delta
from resilient.sdc.checksums import RobustSpike, bitsum, f64_sum, gamma, gather_stats, local, unit_roundoff

_F64_U = 2.0 ** -53


def linear_bound(ops: int, u: float, scale: float, l1_in: float, numel: int, safety: float = 1.0) -> float:
    """The bound on |Σout - scale·Σin| derived in the module docstring."""
    return safety * (gamma(max(ops, 1), u) * abs(scale) * l1_in + 2 * gamma(max(numel, 1), _F64_U) * abs(scale) * l1_in)


try:  # the same function FSDP2 uses to choose its reduce op and divide factors
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    _get_gradient_divide_factors = None
    ReduceScatter = object
    FSDPModule = None


@dataclass
class _Unit:
    """One FSDP2 param group: its comm wrapper's records for the current step."""

    fqn: str
    module: Any
    world: int
    group: Any
    pg: Any                                                      # FSDP2's FSDPParamGroup
    reduce_dtype: torch.dtype | None = None                      # seen at the first call
    scale: float = 1.0
    u: float = 0.0
    cast: bool = False                                           # reduce dtype != param dtype
    post_divide: bool = False                                    # FSDP divides the output after the collective
    armed: bool = True                                           # record this step's reductions?
    spent: Spent = field(default_factory=Spent)                 # host time spent in the sums (overhead)
    in_sum: list[torch.Tensor] = field(default_factory=list)   # each [N] float64, per call
    in_l1: list[torch.Tensor] = field(default_factory=list)
    out_sum: list[torch.Tensor] = field(default_factory=list)  # each 0-dim float64: Σ of the collective's output
    out_bits: list[torch.Tensor] = field(default_factory=list)  # each 0-dim int32: its bit-sum
    outputs: list[torch.Tensor] = field(default_factory=list)  # the output buffers (FSDP views .grad into them)
    numel: int = 0

    def params(self) -> list[nn.Parameter]:
        return [fp.sharded_param for fp in self.pg.fsdp_params]

    def finalize(self) -> None:
        """Derive scale and rounding unit once FSDP has lazily fixed its dtypes.

        Uses FSDP2's own ``_get_gradient_divide_factors`` so the scale is the
        one the reduction really applies (AVG, PREMUL_SUM, pre/post divide).
        """
        if self.u or self.reduce_dtype is None:
            return
        pg, n = self.pg, self.world
        orig = self.params()[0].dtype
        pre, post, rs_op, _ = _get_gradient_divide_factors(self.group, None, self.reduce_dtype, pg.device.type,
                                                           pg.gradient_divide_factor, pg.force_sum_reduction_for_comms)
        if rs_op == dist.ReduceOp.AVG:
            scale = 1.0 / n
        elif rs_op == dist.ReduceOp.SUM:
            scale = 1.0
        else:  # PREMUL_SUM(1/factor): the only other op FSDP2 picks
            scale = 1.0 / float(pg.gradient_divide_factor)
        self.scale = scale / post if post else scale
        self.post_divide = bool(post) and post != 1
        self.cast = self.reduce_dtype != orig
        self.u = max(unit_roundoff(self.reduce_dtype), unit_roundoff(orig))

    def reset(self) -> None:
        for records in (self.in_sum, self.in_l1, self.out_sum, self.out_bits, self.outputs):
            records.clear()
        self.numel = 0

    def hashed_output(self, post_scale: float) -> torch.Tensor | None:
        """The collective's output buffer when this step's gradients ARE that buffer,
        bit for bit, as the collective wrote it; else None.

        True for one reduction per step, with no division or cast after it
        (FSDP's post-divide, a reduce dtype other than the parameters', a
        pipeline's scaling) and every gradient a view of the buffer (FSDP2
        assigns views when ``.grad`` was None; it accumulates into an existing
        one instead). Then the sum and bit-sum taken right after the collective
        describe the gradients the optimizer will read, and any later change of
        them is corruption at rest.
        """
        if len(self.outputs) != 1 or len(self.out_sum) != 1 or self.post_divide or self.cast or post_scale != 1:
            return None
        buf = self.outputs[0]
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        for p in self.params():
            g = p.grad
            if g is None or not lo <= local(g).data_ptr() < hi:
                return None
        return buf


class CheckedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter comm that records float64 per-chunk sums of its input.

    It delegates allocation and the collective to the comm it replaces, so the
    reduced values are bitwise those of an unchecked run. On CUDA the sums are
    enqueued on FSDP's reduce-scatter stream before the collective (the wrapper
    is called there) and read back only after FSDP's end-of-backward wait.
    """

    def __init__(self, inner, unit: _Unit):
        self.inner, self.unit = inner, unit

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n, unit = group.size(), self.unit
        unit.reduce_dtype = input_tensor.dtype
        if not unit.armed:
            return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                              async_op=async_op)
        unit.finalize()
        x = input_tensor.view(n, -1)
        t0 = Spent.now()
        with torch.no_grad():
            fused = native.rows_sum_l1(x)   # CPU float32: both in one pass (native.py has the figures)
            if fused is None:
                # per destination rank; converting inside the reduction beats f64_sum's chunked
                # copies here (measured in the training step: 1.8 vs 2.3 ms for 870k elements).
                # L1 only scales the bound: fp32 accumulation (relative error ~1e-4 at worst) is
                # plenty against a safety factor of 2, and 2x cheaper than float64 on CPU
                # (abs().sum: one pass, ~2.4x cheaper than vector_norm(ord=1) on CPU, measured)
                fused = x.sum(dim=1, dtype=torch.float64), x.abs().sum(dim=1).to(torch.float64)
            unit.in_sum.append(fused[0])
            unit.in_l1.append(fused[1])
        unit.numel += x.shape[1] * n
        unit.spent.since(t0)
        work = self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op, async_op=async_op)
        t2 = Spent.now()
        if not async_op:
            # Hash the output as the collective left it, while it is still in cache: the
            # linear check needs its sum, and its bit-sum lets the check see any later
            # change exactly (:meth:`_Unit.hashed_output`). On CUDA these kernels queue
            # behind the collective on FSDP's reduce-scatter stream, the stream it runs on.
            with torch.no_grad():
                fused = native.sum_bits(output_tensor) or (f64_sum(output_tensor), bitsum(output_tensor))
                unit.out_sum.append(fused[0])
                unit.out_bits.append(fused[1])
            unit.outputs.append(output_tensor)
        unit.spent.since(t2)
        return work


class ReductionCheck:
    """Linear checks of every FSDP2 reduce-scatter of a model, plus per-rank
    pre-reduction sanity (non-finite, L1 spikes). See the module docstring.

    Create with :func:`attach_fsdp`; call :meth:`check` once per step after
    backward (every rank of the dp group, collectively).
    """

    def __init__(self, units: list[_Unit], group, safety: float = 2.0, spike_k: float = 50.0,
                 spike_window: int = 50, spike_warmup: int = 10, post_scale: float = 1.0):
        self.units, self.group, self.safety = units, group, safety
        # the loop's scaling of the reduced gradients before the check (pipeline schedules: 1/n_microbatches)
        self.post_scale = float(post_scale)
        self.ranks = dist.get_process_group_ranks(group) if units else []
        # on log L1: a floor of 0.1 on sigma keeps natural jumps (a hard batch, 2-3x) below
        # k·0.1 while an exponent flip (x2**64 and beyond: +44 in log) is far above it
        self.spikes = {r: RobustSpike(spike_k, spike_window, spike_warmup, min_sigma=0.1) for r in self.ranks}

    def reset(self) -> None:
        """Forget this step's records (call before a replay's backward)."""
        for u in self.units:
            u.reset()

    def arm(self, on: bool) -> None:
        """Record (or skip) the next backward's reductions: steps without a check
        pay nothing in the comm wrapper. Must be the same on every rank."""
        for u in self.units:
            u.armed = on

    @torch.no_grad()
    def check(self, step: int, judge_spikes: bool = True) -> list[Suspicion]:
        """Compare inputs and outputs of this step's reductions; collective over the dp group."""
        if not self.units:
            return []
        return self.judge(step, gather_stats(self.local_rows(), self.group), judge_spikes)

    def width(self) -> int:
        """Numbers per unit in :meth:`local_rows`."""
        return 2 * self.units[0].world + 5 if self.units else 0

    @torch.no_grad()
    def local_rows(self) -> torch.Tensor:
        """This rank's ``[units, 2N+5]`` float64 host table (no communication): per
        destination rank the input sums and L1s; the output sum; the change of the
        output's bit-sum since the collective; calls; numel; whether that bit-sum
        applies (:meth:`_Unit.hashed_output`)."""
        n = self.units[0].world
        dev = self.units[0].params()[0].device if self.units[0].params() else torch.device("cpu")
        sums, l1s, outs, deltas, exact = [], [], [], [], []
        zero_bits = torch.zeros((), dtype=torch.int32, device=dev)
        for u in self.units:
            sums.append(torch.stack(u.in_sum).sum(0) if u.in_sum else torch.zeros(n, dtype=torch.float64, device=dev))
            l1s.append(torch.stack(u.in_l1).sum(0) if u.in_l1 else torch.zeros(n, dtype=torch.float64, device=dev))
            buf = u.hashed_output(self.post_scale)
            exact.append(buf is not None)
            if buf is not None:   # hashed as the collective wrote it: one bit-sum pass now, no float64 pass
                outs.append(u.out_sum[0])
                deltas.append(bitsum(buf) - u.out_bits[0])   # int32 wraps: the delta is taken mod 2**32
                continue
            grads = [local(p.grad) for p in u.params() if p.grad is not None]
            outs.append(torch.stack([f64_sum(g) for g in grads]).sum() if grads
                        else torch.zeros((), dtype=torch.float64, device=dev))
            deltas.append(zero_bits)
        # one device->host copy for all units (one sync on CUDA)
        dev_part = torch.cat([torch.stack(sums), torch.stack(l1s), torch.stack(outs).unsqueeze(1),
                              torch.stack(deltas).to(torch.float64).unsqueeze(1)], dim=1).cpu()
        host_part = torch.tensor([[len(u.in_sum), u.numel, float(e)] for u, e in zip(self.units, exact)],
                                 dtype=torch.float64)
        return torch.cat([dev_part, host_part], dim=1)          # [U, 2N+5]

    def judge(self, step: int, allr: torch.Tensor, judge_spikes: bool = True) -> list[Suspicion]:
        """Suspicions from every dp rank's :meth:`local_rows` (``[N, U, 2N+5]``, in
        group order); the same on every rank. Forgets this step's records."""
        n = self.units[0].world
        self.reset()
        out: list[Suspicion] = []
        bad_in = set()
        # a few vectorised sums, then plain Python lists: this runs every step
        sum_in = allr[:, :, :n].sum(0).tolist()                 # [U][N]: Σ over source ranks
        l1_in_all = allr[:, :, n:2 * n].sum(0).tolist()
        l1_rank = allr[:, :, n:2 * n].sum((1, 2)).tolist()      # [N]: each rank's pre-reduction L1
        rows = allr[:, :, 2 * n:].tolist()                      # [N][U]: out, bits delta, calls, numel, exact
        for k in range(n):                            # pre-reduction sanity of rank k's inputs
            l1k = l1_rank[k]
            if not math.isfinite(l1k):
                bad_in.add(k)
                out.append(Suspicion(step=step, rank=self.ranks[k], kind=KIND_NONFINITE, tensor="*",
                                     evidence={"where": "pre-reduction gradient", "l1": l1k}))
            elif judge_spikes and l1k > 0:
                spike, z = self.spikes[self.ranks[k]].check(math.log(l1k))
                if spike:
                    out.append(Suspicion(step=step, rank=self.ranks[k], kind=KIND_GRAD_SPIKE, tensor="*",
                                         evidence={"log_l1": math.log(l1k), "robust_z": z}))
        for ui, u in enumerate(self.units):
            for r in range(n):   # a reduced gradient must not change between its collective and now
                _, bits_delta, _, _, exact = rows[r][ui]
                if exact and bits_delta:
                    delta, harmless = at_rest_delta(int(bits_delta))
                    out.append(Suspicion(step=step, rank=self.ranks[r], kind=KIND_GRAD_AT_REST, tensor=u.fqn,
                                         harmless=harmless, evidence={"bitsum_delta": delta,
                                                                      "since": "its reduce-scatter"}))
            calls, numel = int(rows[0][ui][2]), int(rows[0][ui][3])
            if calls == 0 or bad_in:
                continue
            u.finalize()
            post = self.post_scale
            ops = (n - 1) + (1 if u.scale != 1 else 0) + (calls - 1) + (1 if u.cast else 0) + (1 if post != 1 else 0)
            for r in range(n):
                expect = post * u.scale * sum_in[ui][r]
                l1_in = l1_in_all[ui][r]
                got = rows[r][ui][0]
                bound = linear_bound(ops, u.u, post * u.scale, l1_in, numel, self.safety)
                err = abs(got - expect)
                if not (err <= bound):   # NaN-safe
                    out.append(Suspicion(step=step, rank=self.ranks[r], kind=KIND_REDUCTION, tensor=u.fqn,
                                         evidence={"sum_out": got, "sum_in_scaled": expect, "err": err,
                                                   "bound": bound, "l1_in": l1_in, "ops": ops, "calls": calls,
                                                   **({"post_scale": post} if post != 1 else {})}))
        return out


def pipeline_post_scale(schedule) -> float:
    """The factor a ``torch.distributed.pipelining`` schedule multiplies the
    reduced gradients by after FSDP2's reduce-scatter: ``1/n_microbatches`` with
    ``scale_grads=True`` (its default), else 1. ``None`` (no pipeline) → 1."""
    if schedule is None or not getattr(schedule, "scale_grads", True):
        return 1.0
    n = getattr(schedule, "_n_microbatches", None)
    if not isinstance(n, int) or n < 1:
        raise SdcError(f"cannot tell how {type(schedule).__name__} scales gradients (no _n_microbatches); "
                       "pass post_scale to watch_fsdp yourself")
    return 1.0 / n


def attach_fsdp(model: nn.Module, group=None, **kw) -> ReductionCheck:
    """Install :class:`CheckedReduceScatter` on every FSDP2 unit of ``model``.

    ``model`` may be one module or several (pipeline stages: pass each, or a
    ``nn.ModuleList``). ``post_scale`` (in ``kw``): the factor the loop applies
    to the reduced gradients before the check (:func:`pipeline_post_scale`
    for a pipeline schedule). Call after ``fully_shard`` and after any
    ``set_symm_mem``/``set_allocate_memory_from_process_group`` (they refuse a
    custom comm). ``group`` defaults to the units' reduce-scatter group.
    Raises :class:`SdcError` for HSDP (not covered) or a torch without FSDP2.
    """
    if FSDPModule is None or _get_gradient_divide_factors is None:
        raise SdcError("this torch has no FSDP2 internals the linear check relies on; disable [sdc] or use torch>=2.6")
    units: list[_Unit] = []
    for fqn, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        groups = m._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        if len(groups) > 1:
            raise SdcError(f"FSDP unit '{fqn}' has {len(groups)} param groups (per-param meshes); the linear check supports one")
        pg = groups[0]
        if isinstance(pg.mesh_info, DDPMeshInfo):
            raise SdcError(f"FSDP unit '{fqn}' uses HSDP/replicate; its extra all-reduce is not covered by the linear check. Use plain FSDP over dp, or disable sdc for it")
        rs_group = pg._reduce_scatter_process_group
        if rs_group.size() == 1:
            continue
        unit = _Unit(fqn=fqn or "<root>", module=m, world=rs_group.size(), group=rs_group, pg=pg)
        m.set_custom_reduce_scatter(CheckedReduceScatter(pg._reduce_scatter_comm, unit))
        units.append(unit)
    if units and group is None:
        group = units[0].group
    return ReductionCheck(units, group, **kw)


@torch.no_grad()
def checked_all_reduce(tensors: Sequence[torch.Tensor], group=None, *, step: int, name: str = "all_reduce",
                       average: bool = True, safety: float = 2.0) -> list[Suspicion]:
    """All-reduce ``tensors`` in place (DDP-style gradient sync) and verify it linearly.

    Each rank records float64 sum/L1 of its inputs, runs the ordinary
    ``all_reduce`` (SUM, then ``/N`` when ``average``), and one all_gather of
    4 numbers per tensor compares every rank's output sum with the sum of all
    inputs (bound as in the module docstring, ``m = N-1 (+1)``). A mismatch
    names the rank whose *output* is off - the tie-breaker that plain replica
    comparison lacks with two replicas.
    """
    n = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    loc = [local(t) for t in tensors]
    ins = [(f64_sum(t), torch.linalg.vector_norm(t, 1).to(torch.float64)) for t in loc]
    for t in loc:
        dist.all_reduce(t, group=group)
        if average:
            t.div_(n)
    rows = torch.stack([torch.stack([a, b, f64_sum(t), torch.tensor(float(t.numel()), dtype=torch.float64)])
                        for (a, b), t in zip(ins, loc)]).cpu() if loc else torch.zeros(0, 4, dtype=torch.float64)
    allr = gather_stats(rows, group)
    scale = 1.0 / n if average else 1.0
    out = []
    for i, t in enumerate(loc):
        bad_in = [r for r in range(n) if not math.isfinite(float(allr[r, i, 1]))]
        if bad_in:   # a non-finite input poisons every output: name its source, not the victims
            out += [Suspicion(step=step, rank=ranks[r], kind=KIND_NONFINITE, tensor=f"{name}[{i}]",
                              evidence={"where": "pre-reduction", "l1": float(allr[r, i, 1])}) for r in bad_in]
            continue
        expect = scale * float(allr[:, i, 0].sum())
        l1 = float(allr[:, i, 1].sum())
        bound = linear_bound(n - 1 + (1 if average else 0), unit_roundoff(t.dtype), scale, l1, int(allr[0, i, 3]), safety)
        for r in range(n):
            got = float(allr[r, i, 2])
            if not (abs(got - expect) <= bound):
                out.append(Suspicion(step=step, rank=ranks[r], kind=KIND_REDUCTION, tensor=f"{name}[{i}]",
                                     evidence={"sum_out": got, "sum_in_scaled": expect, "err": abs(got - expect), "bound": bound}))
    return out
