"""Helpers for tests that run real training jobs as subprocesses: the tests' spelling of the
job runner they share with the benchmarks and the chaos harness (resilient_chaos.launched)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from resilient_chaos.launched import REPO, LaunchedNode, launch_argv, wait_for  # noqa: F401  (the tests' names)
from resilient_chaos.launched import run_events as events

CORPUS_TEXT_BYTES = 400_000  # enough text for tests, quick to prepare


def tiny_overrides(corpus: Path, steps: int = 5, **extra) -> list[str]:
    """A tiny model that trains fast on a test corpus."""
    sets = {
        "model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.max_seq_len": 32,
        "train.seq_len": 32, "train.global_batch": 8, "train.steps": steps, "train.warmup_steps": 2,
        "train.eval_every": 0, "train.log_every": 1, "data.path": str(corpus), "data.source": "",
        "snapshot.every": 0,
    }
    sets.update(extra)
    return [f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in sets.items()]


def run_launch(config: str | Path, run_dir: Path, overrides: list[str], nproc: int | None = None,
               timeout: float = 240, check: bool = True, extra_args: list[str] | None = None,
               script_args: list[str] = ()) -> subprocess.CompletedProcess:
    """``resilient launch`` to its end: ``config`` is a GPT run config, or a script given
    ``script_args`` (options go before it, as for torchrun)."""
    cmd = launch_argv(config, run_dir, nproc=nproc, overrides=overrides, extra_args=extra_args or [],
                      script_args=script_args)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """step → loss, from rank 0's step events."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step") if e["rank"] == 0}


def digests(run_dir: Path) -> dict[int, str]:
    """rank → parameter digest at the end of the run."""
    return {e["rank"]: e["param_digest"] for e in events(run_dir, "run_end")}


class Agent(LaunchedNode):
    """One `resilient launch` agent (a simulated node) in its own session, so the whole node
    (agent and workers) can be killed; its output in ``agent-<run dir>-<node>.log`` beside
    the run dir."""

    def __init__(self, config: str | Path, run_dir: Path, overrides: list[str], node_id: str,
                 nnodes: str = "1", endpoint: str | None = None, nproc: int | None = None,
                 extra_args: list[str] | None = None, script_args: list[str] = ()):
        """``config``: a GPT run config, or a script given ``script_args``."""
        self.node_id = node_id
        super().__init__(launch_argv(config, run_dir, node_id=node_id, nnodes=nnodes, endpoint=endpoint, nproc=nproc,
                                     overrides=overrides, extra_args=extra_args or [], script_args=script_args),
                         run_dir.parent / f"agent-{run_dir.name}-{node_id}.log")

    def kill_node(self) -> None:
        """kill -9 the agent and every process of its node."""
        self.kill()


def worker_pids(run_dir: Path, node: str | None = None) -> dict[int, int]:
    """local rank → pid of the newest workers started (by any agent, or by ``node``)."""
    started = [e for e in events(run_dir, "workers_started") if node is None or e["node"] == node]
    return dict(zip(started[-1]["local_ranks"], started[-1]["pids"])) if started else {}


def steps_done(run_dir: Path) -> int:
    done = [e["step"] for e in events(run_dir, "step") if e["rank"] == 0]
    return max(done, default=0)
