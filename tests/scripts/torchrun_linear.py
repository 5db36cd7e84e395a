"""A plain torchrun training script: it imports torch and nothing of resilient.

Data-parallel training of a tiny Linear with gloo: every rank computes the
gradient of its own deterministic batch (addressed by step and rank), the
gradients are averaged with ``all_reduce``, every rank takes the same SGD step.
Rank 0 checkpoints after every step with ``torch.save`` (atomically) and every
rank resumes from that checkpoint when it exists, as torchrun scripts do to
survive restarts. At the end rank 0 saves the final weights to ``--out``.

For the tests it also appends one JSON line per worker start to
``--log-dir/starts.jsonl`` (its pid, rank, restart count and the environment it
was given) and, with ``--pause-at K``, local rank 1 of the first attempt stops
before step K and waits (bounded) to be killed.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ckpt", required=True, help="checkpoint path (resumed from when present)")
    ap.add_argument("--out", required=True, help="where rank 0 saves the final weights")
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--pause-at", type=int, default=-1)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = {"pid": os.getpid(), "rank": rank, "world": world, "restart": restart,
              "env": {k: v for k, v in os.environ.items()
                      if k.startswith(("RESILIENT_", "TORCHELASTIC_", "MASTER_")) or k in (
                          "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")}}
    with open(os.path.join(args.log_dir, "starts.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
    target = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32

    for step in range(start, args.steps):
        if step == args.pause_at and restart == 0 and int(os.environ["LOCAL_RANK"]) == 1:
            open(os.path.join(args.log_dir, "paused"), "w").close()
            time.sleep(60)  # the test kills this process here
            raise SystemExit("paused for 60 s and nobody killed me")
        g = torch.Generator().manual_seed(1000 + step * world + rank)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x @ target.T)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if rank == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, args.ckpt)
    if rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
