"""Entry point of one worker process: ``python -m resilient.gpt.worker``.

Started by ``resilient launch`` (or torchrun) with the torch.distributed
environment set. Reads the resolved config the launcher wrote as JSON, trains,
and exits 0; on an exception it records a ``worker_error`` event and exits 1,
so the agent sees a failure it can act on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from resilient.gpt.config import config_from_dict
from resilient.job import record_worker_error, said_peer_gone


# Pinned host memory (the capture ring's buffers on a GPU) by malloc + cudaHostRegister on
# 8 threads instead of cudaHostAlloc: measured on an H200 (bench/gpu_check.py, pinned),
# 3 x 4 GiB took 1.75 s against 7.46 s, and a replacement worker allocates them at start.
PINNED_ALLOC = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def allocator_settings(current: str) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` with the pinned-memory settings added, unless the user
    set pinned options of their own."""
    if "pinned_" in current:
        return current
    return f"{current},{PINNED_ALLOC}" if current else PINNED_ALLOC


@record
def main(argv: list[str] | None = None) -> int:
    # Read once, when CUDA first allocates: set before anything touches the GPU.
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = allocator_settings(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    ap = argparse.ArgumentParser(prog="python -m resilient.gpt.worker")
    ap.add_argument("--config", required=True, help="the resolved config as JSON (written by the launcher)")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--node", default=None)
    args = ap.parse_args(argv)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # Forked from a zygote that imported torch before the thread count was known: set it
        # here, where it is (the OpenMP runtime read its environment at that import).
        import torch

        torch.set_num_threads(int(threads))
    with open(args.config) as f:
        cfg = config_from_dict(json.load(f), source=args.config)

    from resilient.gpt.train import Trainer

    trainer, failed = None, False
    try:
        trainer = Trainer(cfg, args.run_dir, node=args.node)
        code = trainer.run()
    except SystemExit as e:  # a decided exit (quarantine, SDC re-forming)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        failed = True
        if said_peer_gone(e):   # after its clean run_end: a peer that left, not an error
            code = 0
        else:
            record_worker_error(e, traceback.format_exc(), run_dir=args.run_dir, node=args.node)
            raise
    finally:
        if trainer is not None:
            trainer.close(failed)
    # Everything is saved and closed: leave now. Interpreter shutdown with
    # gloo's threads still alive can hang in garbage collection, and a worker
    # that never exits looks hung to its agent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
