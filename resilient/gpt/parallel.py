"""3D parallelism with torch's own stack: a (pp, dp, tp) mesh, DTensor tensor
parallel, FSDP2 over dp, and ``torch.distributed.pipelining`` over pp.

Order of application per pipeline stage (the one measured correct on this
stack): build the stage on the meta device → tensor parallel → activation
checkpointing → FSDP2 → materialize and initialize → ``PipelineStage``.
Building on meta and initializing shard by shard keeps host memory at one
stage's shard, so the same code builds a billion-parameter model.

Rank order in the mesh is tp fastest, then dp, then pp: tensor-parallel peers
are neighbours (on a GPU node, the NVLink domain).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from resilient.gpt.config import Config
from resilient.gpt.model import GPT, cross_entropy, init_buffers, init_parameters

SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


@dataclass
class Layout:
    """Where this rank sits in the (pp, dp, tp) mesh."""

    pp: int
    dp: int
    tp: int
    rank: int
    world: int
    mesh: DeviceMesh | None = None

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def as_dict(self) -> dict:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "world": self.world}


def build_layout(cfg: Config, device_type: str) -> Layout:
    world, rank = dist.get_world_size(), dist.get_rank()
    pp, dp, tp = cfg.layout(world)
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return Layout(pp, dp, tp, rank, world, mesh)


def stage_ids(cfg: Config, layout: Layout) -> list[int]:
    """Pipeline stages this rank holds: loop order (rank r holds r, r+pp, ...)."""
    return [layout.pp_rank + k * layout.pp for k in range(cfg.parallel.stages_per_rank)]


def stage_layers(cfg: Config, stage: int, n_stages: int) -> list[int]:
    per = cfg.model.n_layers // n_stages
    return list(range(stage * per, (stage + 1) * per))


def _apply_tp(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style plan: q/k/v and w1/w3 column-wise, wo and w2 row-wise;
    the output head column-wise gathered to full logits. Embeddings and norms
    stay replicated (their gradients agree across tp ranks by construction)."""
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    if model.output is not None:
        parallelize_module(model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())})


def _apply_fsdp(model: GPT, dp_mesh: DeviceMesh, cfg: Config, compute_dtype: torch.dtype) -> None:
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    reshard = cfg.parallel.zero == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root's parameters (embeddings, final norm, head) are used last in
    # forward: no point resharding them only to gather them again in backward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)


@dataclass
class ParallelModel:
    """This rank's share of the model and how to run a step on it."""

    layout: Layout
    parts: list[GPT]                 # one per pipeline stage this rank holds
    stages: list = field(default_factory=list)  # PipelineStage objects (pp > 1)
    schedule: object = None          # a pipelining schedule (pp > 1)
    n_microbatches: int = 1
    autocast_dtype: torch.dtype | None = None

    @property
    def has_first_stage(self) -> bool:
        return any(p.tok_embeddings is not None for p in self.parts)

    @property
    def has_last_stage(self) -> bool:
        return any(p.output is not None for p in self.parts)

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def named_parameters(self):
        for part in self.parts:
            yield from part.named_parameters()

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device_type = next(self.parameters()).device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One step's forward and backward on this rank's batch slice.

        Returns the mean loss over the slice on ranks holding the last stage,
        ``None`` elsewhere. Gradients are left in ``.grad``, averaged over the
        micro-batches (and over dp by FSDP2's reduce-scatter).
        """
        with self.autocast():
            if self.schedule is None:
                return self._accumulate(inputs, targets)
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.has_first_stage else ()
            target = targets if self.has_last_stage else None
            self.schedule.step(*args, target=target, losses=losses)
            return torch.stack(losses).mean().detach() if self.has_last_stage else None

    @torch.no_grad()
    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss :meth:`forward_backward` computes on this batch, without gradients: the
        same micro-batches in the same order, the same arithmetic (the SDC cross-device
        replay compares it bit for bit). Not for pipeline schedules."""
        model, n = self.parts[0], self.n_microbatches
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        with self.autocast():
            for x, y in zip(inputs.chunk(n), targets.chunk(n)):
                total += cross_entropy(model(x), y).detach() / n
        return total

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model, n = self.parts[0], self.n_microbatches
        total = torch.zeros((), dtype=torch.float32, device=inputs.device)
        for x, y in zip(inputs.chunk(n), targets.chunk(n)):
            loss = cross_entropy(model(x), y)
            (loss / n).backward()
            total += loss.detach() / n
        return total

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        with self.autocast():
            if self.schedule is None:
                return cross_entropy(self.parts[0](inputs), targets)
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.has_first_stage else ()
            target = targets if self.has_last_stage else None
            self.schedule.eval(*args, target=target, losses=losses)
            return torch.stack(losses).mean() if self.has_last_stage else None


def build_model(cfg: Config, layout: Layout, device: torch.device, compute_dtype: torch.dtype,
                init: bool = True) -> ParallelModel:
    """This rank's stages of the GPT, parallelized and initialized.

    ``init=False``: the parameters are left as allocated (garbage) for a caller that
    restores them next and initializes only when there is nothing to restore
    (:meth:`resilient.gpt.train.Trainer.restore`): drawing the initial values costs O(params)
    per rank, every worker start, and a restore overwrites them."""
    from torch.distributed import pipelining

    mesh = layout.mesh
    n_stages = layout.pp * cfg.parallel.stages_per_rank
    ids = stage_ids(cfg, layout)
    parts: list[GPT] = []
    for s in ids:
        with torch.device("meta"):
            model = GPT(cfg.model)
        model.keep_layers(first=(s == 0), last=(s == n_stages - 1), layer_ids=stage_layers(cfg, s, n_stages))
        for block in model.layers.values():
            block.checkpoint = cfg.parallel.activation_checkpoint
        if layout.tp > 1:
            _apply_tp(model, mesh["tp"])
        if layout.dp > 1:
            _apply_fsdp(model, mesh["dp"], cfg, compute_dtype)
        model.to_empty(device=device)
        if init:
            init_parameters(model, cfg.train.seed)
        else:
            init_buffers(model)
        parts.append(model)

    # Without FSDP there is no mixed-precision policy: autocast gives bf16
    # compute over fp32 master weights instead.
    autocast_dtype = compute_dtype if (compute_dtype != torch.float32 and layout.dp == 1) else None
    pm = ParallelModel(layout, parts, n_microbatches=cfg.parallel.n_microbatches, autocast_dtype=autocast_dtype)
    if layout.pp == 1:
        return pm
    pp_group = mesh["pp"].get_group()
    pm.stages = [
        pipelining.PipelineStage(part, s, n_stages, device, group=pp_group) for part, s in zip(parts, ids)
    ]
    cls = getattr(pipelining, SCHEDULES[cfg.parallel.pp_schedule])
    stage_arg = pm.stages if cfg.parallel.stages_per_rank > 1 else pm.stages[0]
    pm.schedule = cls(stage_arg, n_microbatches=pm.n_microbatches, loss_fn=cross_entropy, scale_grads=True)
    return pm
