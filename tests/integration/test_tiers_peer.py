"""Peer RAM tier, real processes: two nodes in different failure domains train;
one is killed with kill -9 (agent and workers) and a fresh node takes its place:
the newcomer restores its shards from the survivor's RAM (``restore`` tier
``peer``), and the run ends bitwise equal to a fault-free run of the same layout."""

from __future__ import annotations

import pytest

from launchutil import REPO, Agent, digests, events, run_launch, steps_done, tiny_overrides, wait_for
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import job_dir, reclaim

DEMO = REPO / "configs" / "demo.toml"
STEPS = 30
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # minutes on a loaded 2-core host


def run_id(run_dir) -> str:
    return default_run_id(run_dir)


def overrides(corpus):
    return tiny_overrides(corpus, STEPS, **{"snapshot.every": 1, "snapshot.durable_every": 0,
                                            "snapshot.replicas": 1, "launch.heartbeat_timeout": 60.0})


def test_node_kill_restores_from_peer_ram_bitwise(corpus, tmp_path):
    ref = tmp_path / "ref"
    run_launch(DEMO, ref, overrides(corpus), nproc=2)
    run = tmp_path / "run"
    run.mkdir()
    over = overrides(corpus)
    with embedded_etcd() as etcd:
        a = Agent(DEMO, run, over, "a", nnodes="2", endpoint=etcd.endpoint, nproc=1, extra_args=["--domain", "r1"])
        b = Agent(DEMO, run, over, "b", nnodes="2", endpoint=etcd.endpoint, nproc=1, extra_args=["--domain", "r2"])
        c = None
        try:
            wait_for(lambda: steps_done(run) >= 6, 300, "the first steps")
            wait_for(lambda: [e for e in events(run, "commit") if e["tier"] == "peer"], 30, "a peer commit")
            b.kill_node()
            c = Agent(DEMO, run, over, "c", nnodes="2", endpoint=etcd.endpoint, nproc=1,
                      extra_args=["--domain", "r3"])
            assert a.wait(300) == 0, a.output()[-3000:]
            assert c.wait(300) == 0, c.output()[-3000:]
            # the run finished: a and c removed their stores and the dead b's (same machine)
            assert not job_dir("/dev/shm", run_id(run)).exists()
        finally:
            for agent in (a, b, c):
                if agent is not None:
                    agent.close()
            reclaim("/dev/shm", run_id(run))
    restores = [e for e in events(run, "restore") if e["step"] > 0]
    by_node = {e["node"]: e["tier"] for e in restores}
    assert by_node == {"a": "local", "c": "peer"}, restores
    peer_commits = [e for e in events(run, "commit") if e["tier"] == "peer" and e["node"] in ("a", "b")]
    assert peer_commits and all(e["k"] == 1 for e in peer_commits)
    assert digests(run) == digests(ref) and len(digests(ref)) == 2
