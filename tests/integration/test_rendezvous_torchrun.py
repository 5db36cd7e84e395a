"""Plain ``torchrun --rdzv-backend=etcd3`` runs a gloo script and survives ``kill -9`` of a worker.

This is also the regression test for torch 2.13's shared-TCP-store trap: the
environment here does *not* set TORCH_DISABLE_SHARE_RDZV_TCP_STORE, so the
restart only works because the etcd3 handler opts out of the shared store
(with the shared store, restarted gloo workers read the previous attempt's
addresses and hang or fail).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resilient_chaos.etcd_testing import embedded_etcd, kill_group, unique_run_id

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(150), pytest.mark.usefixtures("job_secret")]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    out = sys.argv[1]
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    MARK = "resilient.test.attempt0"

    def write(name, payload):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, os.path.join(out, name))

    def probe():  # a plain client of the store the workers bootstrap from
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(seconds=20))

    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Shared agent store: record whether attempt 0's keys are still visible
        # (stale gloo addresses are what break restarts), without risking a hang.
        write(f"stale.{rank}", {"stale": probe().check([MARK])})
        sys.exit(0)

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    if restart == 0:
        if rank == 0:
            probe().set(MARK, "1")
        dist.barrier()
        # Report our pid and wait to be killed by the test.
        write(f"pid.{rank}", {"pid": os.getpid()})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    stale = probe().check([MARK])
    write(f"done.{rank}", {"restart": restart, "sum": t.item(), "world": world, "stale": stale})
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _wait_for(paths: list[Path], proc: subprocess.Popen, bound_s: float) -> None:
    end = time.monotonic() + bound_s
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            raise AssertionError(f"torchrun exited early with {proc.returncode}")
        if time.monotonic() > end:
            raise AssertionError(f"workers never wrote {[p.name for p in paths]}")
        time.sleep(0.05)


def _run_torchrun_and_kill_a_worker(tmp_path: Path, conf: str, wait_s: float) -> tuple[int | None, str, Path]:
    """Start torchrun on an embedded etcd, kill -9 rank 1 once both workers run.

    Returns torchrun's exit code (``None`` if it was still running after
    ``wait_s``; it is then killed), its log, and the workers' output dir.
    """
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    rc: int | None = None
    with embedded_etcd() as etcd:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--rdzv-backend=etcd3",
            f"--rdzv-endpoint={etcd.endpoint}",
            f"--rdzv-id={unique_run_id('torchrun')}",
            f"--rdzv-conf=last_call_timeout=0.5,join_timeout=60,keep_alive_interval=1{conf}",
            "--nnodes=1:2",
            "--nproc-per-node=2",
            "--max-restarts=2",
            "--monitor-interval=0.2",
            "--local-addr=127.0.0.1",
            f"--log-dir={tmp_path / 'torchelastic'}",  # torch's default is a new /tmp/torchelastic_* each start
            str(script), str(out),
        ]
        log = tmp_path / "torchrun.log"
        with open(log, "wb") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        try:
            _wait_for([out / "pid.0", out / "pid.1"], proc, 90)
            victim = json.loads((out / "pid.1").read_text())["pid"]
            os.kill(victim, signal.SIGKILL)
            try:
                rc = proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                rc = None
        finally:
            kill_group(proc)
    return rc, log.read_text(errors="replace"), out


def test_torchrun_etcd3_survives_worker_kill(tmp_path):
    rc, text, out = _run_torchrun_and_kill_a_worker(tmp_path, "", wait_s=120)
    assert rc == 0, text[-4000:]
    for rank in (0, 1):
        done = json.loads((out / f"done.{rank}").read_text())
        assert done == {"restart": 1, "sum": 3.0, "world": 2, "stale": False}, text[-4000:]


def test_shared_tcp_store_leaks_previous_attempt(tmp_path):
    """Why the etcd3 handler opts out of torch's shared agent store (torch 2.13).

    With sharing, restarted workers bootstrap from the agent's long-lived
    store and see attempt 0's keys (for gloo: stale peer addresses, so the
    restart hangs or fails). If this starts failing, torch fixed the trap and
    the opt-out in resilient/rendezvous/registry.py can go.
    """
    rc, text, out = _run_torchrun_and_kill_a_worker(tmp_path, ",share_tcp_store=true", wait_s=120)
    assert rc == 0, text[-4000:]
    for rank in (0, 1):
        assert json.loads((out / f"stale.{rank}").read_text()) == {"stale": True}, text[-4000:]


@contextlib.contextmanager
def _cpu_hogs(n: int):
    """n busy processes for the block's length: a loaded host."""
    procs: list[subprocess.Popen] = []
    try:
        procs += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


# Four lines, as a user writes them: no destroy_process_group().
PLAIN = "import torch, torch.distributed as dist\n" \
        "dist.init_process_group('gloo')\n" \
        "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t)\n" \
        "print(f'rank {dist.get_rank()} sum {t.item()}')\n"


# Issue 44: a script that never calls destroy_process_group() aborted at interpreter exit now
# and then ("terminate called without an active exception", exit -6: 4 of 30 runs beside 3 CPU
# hogs, on torch's c10d rendezvous too); the etcd3 rendezvous now gives its workers an exit hook
# (resilient/rendezvous/worker_exit.py; tests/integration/test_rendezvous_worker_exit.py tests it
# deterministically). Run twice here, where it rarely showed; the soak that showed it (add
# RESILIENT_SOAK_RDZV_CONF=destroy_at_exit=false to see it fail without the hook):
#   RESILIENT_SOAK_RUNS=30 RESILIENT_SOAK_HOGS=3 python3 -m pytest -q tests/integration/test_rendezvous_torchrun.py -k destroy
SOAK_RUNS = int(os.environ.get("RESILIENT_SOAK_RUNS", "2"))
SOAK_HOGS = int(os.environ.get("RESILIENT_SOAK_HOGS", "0"))  # busy processes beside it: a loaded host
SOAK_RDZV_CONF = os.environ.get("RESILIENT_SOAK_RDZV_CONF", "")


@pytest.mark.timeout(30 + 60 * SOAK_RUNS)
def test_a_script_without_destroy_process_group_ends_cleanly_every_time(tmp_path):
    """Issue 44: SOAK_RUNS runs of a script that never calls destroy_process_group(), each must
    exit 0 on every rank with no abort at interpreter exit."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1")
    with embedded_etcd() as etcd, _cpu_hogs(SOAK_HOGS):
        for attempt in range(SOAK_RUNS):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=etcd3",
                   f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={unique_run_id('plain')}",
                   *([f"--rdzv-conf={SOAK_RDZV_CONF}"] if SOAK_RDZV_CONF else []),
                   "--nnodes=1", "--nproc-per-node=2", f"--log-dir={tmp_path / f'log{attempt}'}", str(script)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                    start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=120)
            finally:
                kill_group(proc)
            assert proc.returncode == 0 and "terminate called" not in out, f"run {attempt}: {out[-4000:]}"
            # Each rank's line is one write (an f-string); the two may interleave with the newlines.
            assert all(f"rank {r} sum 3.0" in out for r in (0, 1)), out[-4000:]
