"""Helpers for tests that run real training jobs as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from resilient.events import read_events

REPO = Path(__file__).resolve().parent.parent
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
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    if nproc:
        cmd += ["--nproc-per-node", str(nproc)]
    cmd += extra_args or []
    cmd += [str(config), *script_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "events.jsonl"
    evs = list(read_events(path)) if path.exists() else []
    return [e for e in evs if kind is None or e["event"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """step → loss, from rank 0's step events."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step") if e["rank"] == 0}


def digests(run_dir: Path) -> dict[int, str]:
    """rank → parameter digest at the end of the run."""
    return {e["rank"]: e["param_digest"] for e in events(run_dir, "run_end")}


class Agent:
    """One `resilient launch` agent (a simulated node) as a subprocess in its
    own session, so the whole node — agent and workers — can be killed."""

    def __init__(self, config: str | Path, run_dir: Path, overrides: list[str], node_id: str,
                 nnodes: str = "1", endpoint: str | None = None, nproc: int | None = None,
                 extra_args: list[str] | None = None, script_args: list[str] = ()):
        """``config``: a GPT run config, or a script given ``script_args``."""
        # Options first, then the config (the GPT) or the script and its own arguments.
        cmd = [sys.executable, "-m", "resilient.cli", "launch", "--run-dir", str(run_dir),
               "--node-id", node_id, "--nnodes", nnodes]
        if endpoint:
            cmd += ["--rdzv-endpoint", endpoint]
        if nproc:
            cmd += ["--nproc-per-node", str(nproc)]
        for o in overrides:
            cmd += ["--set", o]
        cmd += extra_args or []
        cmd += [str(config), *script_args]
        self.node_id = node_id
        self.log = open(run_dir.parent / f"agent-{run_dir.name}-{node_id}.log", "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.node_id} still running after {timeout}s:\n{self.output()[-3000:]}")

    def kill_node(self) -> None:
        """kill -9 the agent and every process of its node."""
        import signal as _signal

        try:
            os.killpg(self.proc.pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def close(self) -> None:
        self.kill_node()
        self.log.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what``."""
    import time as _time

    deadline = _time.monotonic() + timeout
    while _time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        _time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def worker_pids(run_dir: Path, node: str | None = None) -> dict[int, int]:
    """local rank → pid of the newest workers started (by any agent, or by ``node``)."""
    started = [e for e in events(run_dir, "workers_started") if node is None or e["node"] == node]
    return dict(zip(started[-1]["local_ranks"], started[-1]["pids"])) if started else {}


def steps_done(run_dir: Path) -> int:
    done = [e["step"] for e in events(run_dir, "step") if e["rank"] == 0]
    return max(done, default=0)
