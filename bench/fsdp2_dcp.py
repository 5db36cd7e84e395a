"""The anchor of bench_ownscript.py: examples/fsdp2_train.py's training under plain torchrun,
checkpointed the way a careful torchrun user does it, with no resilient at all.

Same model, data, sampler and seed as the example (all from examples/toy.py), FSDP2 over
every rank; instead of ``resilient.Job``, torch's distributed checkpoint (DCP):

- every ``--every`` steps ``dcp.async_save`` of the model and optimizer (``get_state_dict``
  through a ``Stateful``, as in PyTorch's async-checkpoint recipe) and the sampler's
  position, into ``RUN_DIR/dcp/step-N``; like torchtitan's ``async`` mode: a gloo group of
  its own for the save's collectives (the upload thread must not interleave its collectives
  with FSDP's on the default group), at most one save in flight (the previous save's future
  is waited on before the next one starts), the oldest checkpoints deleted on a thread,
  keeping the newest ``--keep``;
- ``--mode process``: torchtitan's ``async_with_pinned_mem`` mode as CPU allows it (no pinned
  memory): the upload in a process of DCP's own, the staging copy on a thread into shared
  memory (``DefaultStager``), overlapping the next forward/backward; the loop waits for it
  before the optimizer step changes the state, and that wait counts as blocked time too;
- at start, ``dcp.load`` of the newest complete checkpoint (one whose ``.metadata`` exists:
  DCP renames it into place last, after every rank's data is written), chosen by rank 0.

torchrun restarts the whole worker group after a failure (``--max-restarts``) and this
script resumes from there. Each rank appends JSON lines to ``RUN_DIR/events.jsonl`` in the
shape of resilient's events, so one reader serves both sides of the benchmark:
``run_start`` (``start_step``, the attempt), ``restore`` (``seconds`` of ``dcp.load``), and
per step ``step`` (``time`` = when the optimizer step finished, ``blocked_s`` = how long
checkpointing then held the training loop: waiting for the previous save, staging the copy
and starting the upload). Usage::

    torchrun --nproc-per-node 2 --max-restarts 3 bench/fsdp2_dcp.py --run-dir RUN --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from toy import Batches, ResumableSampler, TinyTransformer, arguments  # noqa: E402

STEP_DIR = re.compile(r"step-(\d+)$")


class AppState(Stateful):
    """What one checkpoint holds: DCP calls ``state_dict()`` when it saves (after the optimizer
    step) and ``load_state_dict()`` after it loaded into that same structure."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: ResumableSampler):
        self.model, self.optimizer, self.sampler = model, optimizer, sampler

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.sampler.load_state_dict(state["sampler"])


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := STEP_DIR.search(p.name)) and (p / ".metadata").is_file())


class Purger:
    """Deletes old checkpoint directories on a thread (as torchtitan's purge thread does):
    an ``rmtree`` in the loop would be blocked time of its own."""

    def __init__(self, root: Path, keep: int):
        self.root, self.keep, self.todo = root, keep, queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def after_save(self) -> None:
        """Call when no save is in flight: every directory but the newest ``keep`` complete
        checkpoints goes (older ones, and ones a killed attempt left half-written)."""
        keep = set(complete_steps(self.root)[-self.keep:])
        for p in self.root.iterdir():
            m = STEP_DIR.search(p.name)
            if m and int(m.group(1)) not in keep and int(m.group(1)) < max(keep, default=0):
                self.todo.put(p)

    def _run(self) -> None:
        while True:
            shutil.rmtree(self.todo.get(), ignore_errors=True)


def own_arguments() -> tuple[argparse.Namespace, argparse.Namespace]:
    """This script's options; the rest are the example's (``toy.arguments``)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--run-dir", required=True, help="checkpoints go to RUN_DIR/dcp, JSON lines to RUN_DIR/events.jsonl")
    ap.add_argument("--every", type=int, default=1, help="async_save every N steps")
    ap.add_argument("--keep", type=int, default=2, help="complete checkpoints kept (≥ 2: the newest may be in flight)")
    ap.add_argument("--mode", choices=("thread", "process"), default="thread",
                    help="thread: torchtitan's 'async' (staging copy inside the call, upload on a thread); "
                         "process: its 'async_with_pinned_mem' on CPU (staging on a thread, upload in a process)")
    mine, rest = ap.parse_known_args()
    if mine.keep < 2:
        ap.error("--keep must be at least 2: the newest checkpoint may still be being written")
    sys.argv[1:] = rest
    return mine, arguments()


def main() -> None:
    mine, args = own_arguments()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(mine.run_dir)
    root = run_dir / "dcp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "events.jsonl", "a", buffering=1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def emit(kind: str, **fields) -> None:
        log.write(json.dumps({"event": kind, "time": time.time(), "rank": rank, **fields}) + "\n")

    torch.manual_seed(args.seed)
    model = TinyTransformer(args.dim, args.layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = ResumableSampler(args.dataset_size, args.seed)
    batches = Batches(model, sampler, args, rank, world)
    state = {"app": AppState(model, optimizer, sampler)}

    # Resume: every rank loads the checkpoint rank 0 found (one file system, one choice).
    found = [complete_steps(root)[-1:] or [0]]
    dist.broadcast_object_list(found, src=0)
    start = found[0][0]
    if start:
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(root / f"step-{start}"))
        emit("restore", step=start, tier="dcp", seconds=round(time.perf_counter() - t0, 4))
    emit("run_start", start_step=start, attempt=attempt, total_steps=args.steps)

    save_group = dist.new_group(backend="gloo")
    purger = Purger(root, mine.keep) if rank == 0 else None
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=False)) if mine.mode == "process" else None
    pending = staging = None
    for step in range(start, args.steps):
        loss = batches.forward_backward(step)
        t0 = time.perf_counter()
        if staging is not None:
            staging.result()  # the previous save's copy must be done before the state changes
            staging = None
        waited = time.perf_counter() - t0
        optimizer.step()
        optimizer.zero_grad()
        done, t_done = step + 1, time.time()
        t0 = time.perf_counter()
        if done % mine.every == 0:
            if pending is not None:
                pending.result()  # at most one save in flight: its copy must not be overwritten
                if purger:
                    purger.after_save()
            ckpt = str(root / f"step-{done}")
            if stager is None:
                pending = dcp.async_save(state, checkpoint_id=ckpt, process_group=save_group)
            else:
                resp = dcp.async_save(state, checkpoint_id=ckpt, process_group=save_group, async_stager=stager,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
                pending, staging = resp.upload_completion, resp.staging_completion
        blocked = waited + time.perf_counter() - t0
        log.write(json.dumps({"event": "step", "time": t_done, "rank": rank, "step": done,
                              "loss": float(loss.detach().double()), "blocked_s": round(blocked, 6)}) + "\n")
    if pending is not None:
        pending.result()
    if stager is not None:
        stager.close()
    emit("run_end", step=args.steps)
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
