"""Local RAM tier, real processes: kill -9 a worker → its replacement restores from
its own node's shared-memory store (``restore`` tier ``local``) and the run ends
bitwise equal to a fault-free run; the store is gone after the job ends."""

from __future__ import annotations

import os
import signal

import pytest

from launchutil import REPO, Agent, digests, events, run_launch, steps_done, tiny_overrides, wait_for, worker_pids
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import job_dir, reclaim

DEMO = REPO / "configs" / "demo.toml"
STEPS = 24
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # minutes on a loaded 2-core host


def run_id(run_dir) -> str:
    return default_run_id(run_dir)


def overrides(corpus):
    # durable only at the end: a mid-run restore can only come from RAM
    return tiny_overrides(corpus, STEPS, **{"snapshot.every": 1, "snapshot.durable_every": 0,
                                            "launch.heartbeat_timeout": 60.0})


def shm_trees(run_dir) -> list[str]:
    root = job_dir("/dev/shm", default_run_id(run_dir))
    return os.listdir(root) if root.exists() else []


def test_worker_kill_restores_from_local_ram_bitwise(corpus, tmp_path):
    ref = tmp_path / "ref"
    run_launch(DEMO, ref, overrides(corpus), nproc=2)
    assert not shm_trees(ref), "a clean exit must leave no node store behind"
    run = tmp_path / "run"
    run.mkdir()
    with embedded_etcd() as etcd:
        agent = Agent(DEMO, run, overrides(corpus), "n0", endpoint=etcd.endpoint, nproc=2)
        try:
            wait_for(lambda: steps_done(run) >= 6, 300, "the first steps")
            assert shm_trees(run) == ["n0"]
            os.kill(worker_pids(run)[1], signal.SIGKILL)
            assert agent.wait(300) == 0, agent.output()[-3000:]
            assert not shm_trees(run), "the agent removes its store when the job ends"
        finally:
            agent.close()
            reclaim("/dev/shm", run_id(run))
    restores = [e for e in events(run, "restore") if e["step"] > 0]
    assert len(restores) >= 2 and {e["tier"] for e in restores} == {"local"}, restores
    assert {e["rank"] for e in restores[:2]} == {0, 1} and restores[0]["step"] >= 5
    assert any(e["event"] == "commit" and e["tier"] == "local" for e in events(run))
    assert digests(run) == digests(ref) and len(digests(ref)) == 2
