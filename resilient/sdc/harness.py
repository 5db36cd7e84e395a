"""A small pool of gloo worker processes for SDC experiments, tests and benches.

Detection-rate tables need hundreds of short multi-process runs; starting a
process group per run costs seconds of ``import torch`` each. :class:`GlooPool`
starts ``world_size`` workers once (forked from a forkserver that preloaded
torch, so no worker pays the import and none inherits a used OpenMP pool), joins
them into one gloo process group, and then runs any picklable function
``fn(rank, world_size, *args)`` on all ranks at once, returning the per-rank
results. Every wait has a ``datetime.timedelta`` limit; :meth:`close` (also on
``with`` exit and on a timeout) ends every worker it started, by its own handle.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "resilient.sdc"]


def free_port() -> int:
    """A TCP port the kernel just handed out (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inq, outq, timeout_s: float, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        outq.put((rank, True, "ready"))
    except Exception:  # noqa: BLE001 - reported to the parent verbatim
        outq.put((rank, False, traceback.format_exc()))
        return
    try:
        while True:
            task = inq.get()
            if task is None:
                break
            fn, args = task
            try:
                outq.put((rank, True, fn(rank, world, *args)))
            except Exception:  # noqa: BLE001
                outq.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooPool:
    """``world_size`` gloo workers that run functions together. See the module doc."""

    def __init__(self, world_size: int, *, timeout: timedelta = timedelta(seconds=60),
                 collective_timeout: timedelta = timedelta(seconds=30), threads: int = 1):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.world_size, self.timeout = world_size, timeout
        self.outq = ctx.Queue()
        self.inqs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True, name=f"gloo-pool-{r}",
                                  args=(r, world_size, port, self.inqs[r], self.outq,
                                        collective_timeout.total_seconds(), threads))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        try:
            self._collect(timeout)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: timedelta) -> list[Any]:
        results: dict[int, Any] = {}
        errors = []
        import time
        deadline = time.monotonic() + timeout.total_seconds()
        while len(results) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise TimeoutError(f"gloo pool: {self.world_size - len(results) - len(errors)} ranks silent after {timeout}")
            try:
                rank, ok, value = self.outq.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(f"gloo pool workers died: {dead}") from None
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close()
            raise RuntimeError("task failed on a worker (pool closed):\n" + "\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: timedelta | None = None) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every worker; per-rank results."""
        if not self.procs:
            raise RuntimeError("gloo pool is closed")
        for q in self.inqs:
            q.put((fn, args))
        return self._collect(timeout or self.timeout)

    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stop every worker: ask, then terminate, then kill the ones still alive."""
        for q in self.inqs:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout.total_seconds() / max(1, len(self.procs)))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        self.procs = []

    def __enter__(self) -> "GlooPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
