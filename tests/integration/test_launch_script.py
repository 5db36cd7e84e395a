"""`resilient launch SCRIPT`: an unmodified torchrun script (tests/scripts/torchrun_linear.py,
no import of resilient) runs under the agent with torchrun's environment, is restarted
after a worker is killed with SIGKILL, and ends with the same weights, bit for bit, as a
fault-free run under the agent and a run under torchrun. Real etcd, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from launchutil import REPO, wait_for
from resilient.runconfig import runtime_config_from_dict

pytestmark = pytest.mark.timeout(180)

SCRIPT = REPO / "tests" / "scripts" / "torchrun_linear.py"
STEPS = 30
PAUSE_AT = 12


def _script_args(out: Path, pause_at: int = -1) -> list[str]:
    out.mkdir()
    return [str(SCRIPT), "--steps", str(STEPS), "--ckpt", str(out / "ckpt.pt"), "--out", str(out / "final.pt"),
            "--log-dir", str(out), "--pause-at", str(pause_at)]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    # Every node of a job shares a secret (resilient.secret); through the environment it works with any etcd.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RESILIENT_JOB_SECRET="5e" * 32)
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 90) -> int:
    """Its exit code; whatever happens, nothing of its process tree is left running."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout}s:\n{log.read_text()[-3000:]}") from None
    finally:
        _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [proc, *tree]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _resilient_launch(tmp: Path, name: str, endpoint: str, script_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(tmp / name),
           "--rdzv-endpoint", endpoint, "--rdzv-id", f"script-{name}", "--node-id", "n0", *script_args]
    return _start(cmd, tmp / f"{name}.log")


def _starts(out: Path) -> list[dict]:
    path = out / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path)


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


def test_a_torchrun_script_is_restarted_after_a_kill_and_ends_as_under_torchrun(tmp_path, etcd):
    # Under the agent, local rank 1 of the first attempt stops before step PAUSE_AT; we kill it.
    faulty, clean, ref = tmp_path / "faulty-out", tmp_path / "clean-out", tmp_path / "torchrun-out"
    agent = _resilient_launch(tmp_path, "faulty", etcd.endpoint, _script_args(faulty, PAUSE_AT))
    try:
        wait_for(lambda: (faulty / "paused").exists() or agent.poll() is not None, 60, "the worker's pause")
        assert agent.poll() is None, (tmp_path / "faulty.log").read_text()[-3000:]
        victim = next(s["pid"] for s in _starts(faulty) if s["env"]["LOCAL_RANK"] == "1" and s["restart"] == 0)
        assert victim in {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        _kill_tree(agent)
        raise
    assert _finish(agent, tmp_path / "faulty.log") == 0, (tmp_path / "faulty.log").read_text()[-3000:]

    starts = _starts(faulty)
    assert sorted((s["restart"], s["rank"]) for s in starts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for s in starts:  # torchrun's environment, and the contract resilient.job reads
        env = s["env"]
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2" and env["RANK"] == str(s["rank"])
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(s["restart"]) and env["TORCHELASTIC_RUN_ID"] == "script-faulty"
        assert env["RESILIENT_RUN_DIR"] == str((tmp_path / "faulty").resolve()) and env["RESILIENT_NODE_ID"] == "n0"
        runtime = json.loads(Path(env["RESILIENT_RUNTIME_CONFIG"]).read_text())
        assert runtime_config_from_dict(runtime).launch.max_restarts == 100
    restarted = [e for e in map(json.loads, (tmp_path / "faulty" / "events.jsonl").read_text().splitlines())
                 if e["event"] == "workers_started"]
    assert len(restarted) == 2 and restarted[1]["warm"] == 2  # forked from the warm zygote

    # Fault-free under the agent, then under torchrun: the same weights, bit for bit.
    agent = _resilient_launch(tmp_path, "clean", etcd.endpoint, _script_args(clean))
    assert _finish(agent, tmp_path / "clean.log") == 0, (tmp_path / "clean.log").read_text()[-3000:]
    torchrun = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       f"--log-dir={tmp_path / 'torchelastic'}",  # not a new /tmp/torchelastic_* per run
                       *_script_args(ref)], tmp_path / "torchrun.log")
    assert _finish(torchrun, tmp_path / "torchrun.log") == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    assert [s["restart"] for s in _starts(clean)] == [0, 0]
    reference = _weights(ref / "final.pt")
    _assert_bitwise_equal(_weights(clean / "final.pt"), reference)
    _assert_bitwise_equal(_weights(faulty / "final.pt"), reference)
