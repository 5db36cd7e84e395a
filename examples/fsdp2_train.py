"""A user's own FSDP2 training script, made resilient by a handful of lines.

A small transformer (torch's own ``nn.TransformerEncoderLayer``, not
resilient's GPT; see ``toy.py``) learns a synthetic sequence task, sharded
with FSDP2 (``fully_shard``) over every rank. Data is addressed by global
sample index through a resumable sampler, so a step sees the same samples
whatever the number of ranks. The lines marked ``# resilient`` are all it
takes to get snapshots in node RAM, peer replicas and durable storage,
restore (resharded to the current number of ranks) after any failure,
preemption handling, and the SDC checks (``batch=`` and ``recompute=``: a sampled
step's forward recomputed on a neighbour's device, the check that sees a device
computing a wrong attention or norm)::

    resilient launch --nproc-per-node 2 examples/fsdp2_train.py --steps 200
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --steps 200   # durable tier only

``--trace FILE`` appends the sample ids each rank trained on at each step
(JSON lines), so tests can check that no sample is repeated or skipped across
a restore.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from toy import Batches, ResumableSampler, TinyTransformer, arguments, init_process_group, trace

import resilient  # resilient


def train(model: torch.nn.Module, args, rank: int, world: int) -> None:
    """The training loop, with the lines resilient adds (``ddp_train.py`` runs it too)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = ResumableSampler(args.dataset_size, args.seed)
    batches = Batches(model, sampler, args, rank, world)

    job = resilient.Job(model=model, optimizer=optimizer, state={"sampler": sampler})  # resilient

    for step in job.steps(args.steps):                                     # resilient
        loss = batches.forward_backward(step)
        if not job.verify(loss, replay=lambda: batches.forward_backward(step),  # resilient
                          batch=batches.batch(step), recompute=batches.loss):    # resilient
            continue                                                       # resilient
        optimizer.step()
        optimizer.zero_grad()
        if args.trace:
            trace(args.trace, step + 1, rank, world, batches.ids(step))
    job.close()                                                            # resilient


def main() -> None:
    args = arguments()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = TinyTransformer(args.dim, args.layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, args, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
