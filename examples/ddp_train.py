"""The same user script with DDP instead of FSDP2: the state is replicated, every
rank holds all of it, and the SDC checks compare the replicas bitwise (gradients
after the all-reduce, parameters after the step). See ``fsdp2_train.py``::

    resilient launch --nproc-per-node 2 examples/ddp_train.py --steps 200
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from toy import Batches, ResumableSampler, TinyTransformer, arguments, init_process_group, trace

import resilient  # resilient


def main() -> None:
    args = arguments()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(TinyTransformer(args.dim, args.layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = ResumableSampler(args.dataset_size, args.seed)
    batches = Batches(model, sampler, args, rank, world)

    job = resilient.Job(model=model, optimizer=optimizer, state={"sampler": sampler})  # resilient

    for step in job.steps(args.steps):                                     # resilient
        loss = batches.forward_backward(step)
        if not job.verify(loss, replay=lambda: batches.forward_backward(step)):  # resilient
            continue                                                       # resilient
        optimizer.step()
        optimizer.zero_grad()
        if args.trace:
            trace(args.trace, step + 1, rank, world, batches.ids(step))
    job.close()                                                            # resilient
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
