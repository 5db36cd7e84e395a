"""The same user script with DDP instead of FSDP2: the state is replicated, every
rank holds all of it, and the SDC checks compare the replicas bitwise (gradients
after the all-reduce, parameters after the step). The loop, with the lines resilient
adds, is ``fsdp2_train.py``'s ``train``; only the model's wrapping differs::

    resilient launch --nproc-per-node 2 examples/ddp_train.py --steps 200
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from fsdp2_train import train
from torch.nn.parallel import DistributedDataParallel
from toy import TinyTransformer, arguments, init_process_group


def main() -> None:
    args = arguments()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    train(DistributedDataParallel(TinyTransformer(args.dim, args.layers)), args, rank, world)  # the same loop
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
