"""A fail-slow drill: a tiny data-parallel loop under :class:`~resilient.job.Job` on a
:class:`~resilient.sdc.harness.GlooPool`, with something done to its processes from
outside as its steps go by. What the tests and ``bench/bench_failslow.py`` run.

The loop is a plain one (gradients averaged with ``dist.all_reduce``, no timing code
in it): what the fail-slow checks see of it is what any script gets.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from resilient.contract import events_path


def train(rank: int, world: int, run_dir: str, steps: int, keep_history: bool = False,
          sets: tuple[str, ...] = (), nodes: tuple[str, ...] = ()) -> dict:
    """Pool task: ``steps`` steps of a 2-layer MLP (~10-20 ms each on one thread); returns
    this rank's verdicts (cause, slow_rank, step, action) and, with ``keep_history``, every
    timing matrix it judged (rank 0). ``nodes``: the node each rank says it runs on (default:
    every rank on this one), as an agent would tell it."""
    import os
    import signal
    import warnings

    import torch
    import torch.distributed as dist

    from resilient.job import Job, NotUnderAgent
    from resilient.contract import NODE_ID_ENV
    from resilient.runconfig import load_runtime_config

    before = os.environ.get(NODE_ID_ENV)
    if nodes:
        os.environ[NODE_ID_ENV] = nodes[rank]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(64, 256, generator=torch.Generator().manual_seed(rank))
    cfg = load_runtime_config(None, ["snapshot.durable_every=0", "sdc.enable=false", *sets])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotUnderAgent)
        job = Job(model, opt, run_dir=run_dir, config=cfg, progress=False)
    if keep_history and rank == 0:
        job.failslow.history = []
    try:
        for _ in job.steps(steps):
            for _ in range(4):
                loss = model(data).square().mean()
                loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()
        return {"stragglers": [(s.cause, s.slow_rank, s.step, d.action) for s, d in job.failslow.stragglers],
                "history": job.failslow.history}
    finally:
        job.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if nodes:   # the pool's process runs other tasks after this one
            if before is None:
                os.environ.pop(NODE_ID_ENV, None)
            else:
                os.environ[NODE_ID_ENV] = before


def rank0_steps(run_dir: Path) -> Callable[[], list[dict]]:
    """A reader of the ``step`` events rank 0 appended since the last call."""
    path, offset = events_path(run_dir), 0

    def poll() -> list[dict]:
        nonlocal offset
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        offset += end
        out = []
        for line in data[:end].splitlines():
            e = json.loads(line)
            if e.get("event") == "step" and e.get("rank") == 0:
                out.append(e)
        return out
    return poll


def run_drill(pool: Any, run_dir: str | Path, steps: int, at_step: Callable[[int], None] | None = None,
              keep_history: bool = False, sets: tuple[str, ...] = (), nodes: tuple[str, ...] = ()) -> list[dict]:
    """Run :func:`train` on ``pool``; ``at_step(step)`` is called here as rank 0's steps
    appear (to inject, from outside, while the job runs). Per-rank results."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "out", pool.run(train, str(run_dir), steps, keep_history, tuple(sets), tuple(nodes))), daemon=True)
    worker.start()
    poll = rank0_steps(Path(run_dir))
    while worker.is_alive():
        for e in poll():
            if at_step is not None:
                at_step(e["step"])
        time.sleep(0.005)
    worker.join()
    if "out" not in result:
        raise RuntimeError("the drill's pool task failed (see the pool's error above)")
    return result["out"]
