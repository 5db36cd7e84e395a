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
               timeout: float = 240, check: bool = True, extra_args: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "resilient.cli", "launch", str(config), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    if nproc:
        cmd += ["--nproc-per-node", str(nproc)]
    cmd += extra_args or []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    evs = list(read_events(run_dir / "events.jsonl"))
    return [e for e in evs if kind is None or e["event"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """step → loss, from rank 0's step events."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step") if e["rank"] == 0}


def digests(run_dir: Path) -> dict[int, str]:
    """rank → parameter digest at the end of the run."""
    return {e["rank"]: e["param_digest"] for e in events(run_dir, "run_end")}
