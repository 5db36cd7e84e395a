"""Lose a node and shrink dp: three nodes (dp=3) train, one is killed with kill -9,
the two survivors re-form as dp=2 and restore the lost node's shards from peer
RAM, resharded to the new layout; the losses go on where they left off."""

from __future__ import annotations

import time

import pytest

from launchutil import REPO, Agent, events, losses, steps_done, tiny_overrides, wait_for

from resilient_chaos.etcd_testing import embedded_etcd
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import reclaim

DEMO = REPO / "configs" / "demo.toml"
STEPS = 40
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # minutes on a loaded 2-core host


def run_id(run_dir) -> str:
    return default_run_id(run_dir)


def test_node_loss_shrinks_dp_restoring_from_peers(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    over = tiny_overrides(corpus, STEPS, **{"snapshot.every": 1, "snapshot.durable_every": 0,
                                            "train.global_batch": 12, "launch.heartbeat_timeout": 60.0})
    with embedded_etcd() as etcd:
        agents = {n: Agent(DEMO, run, over, n, nnodes="2:3", endpoint=etcd.endpoint, nproc=1,
                           extra_args=["--domain", f"rack-{n}"]) for n in ("a", "b", "c")}
        try:
            wait_for(lambda: any(len(e["nodes"]) == 3 for e in events(run, "rendezvous")), 600, "a 3-node round")  # 3 cold starts
            # The three nodes' own version replicated: on a loaded host the first round may form with
            # two (min 2, the third still importing torch), whose versions are peer-committed first; a
            # node lost before the 3-rank world committed one would restore a 2-rank version, unresharded.
            wait_for(lambda: [e for e in events(run, "commit") if e["tier"] == "peer" and e["world"] == 3], 300,
                     "a peer commit of the 3-rank world")
            assert steps_done(run) < STEPS, "the job ended before the node was lost: raise STEPS"
            before = dict(losses(run))
            killed = time.time()
            agents["b"].kill_node()
            assert agents["a"].wait(300) == 0, agents["a"].output()[-3000:]
            assert agents["c"].wait(300) == 0, agents["c"].output()[-3000:]
        finally:
            for agent in agents.values():
                agent.close()
            reclaim("/dev/shm", run_id(run))  # a node killed with -9 left its store
    # The first restore after the loss reads the 3-rank version into the 2-rank layout. A worker
    # restarted besides (a loaded host: a heartbeat missed before the loss, or a second re-form
    # after it) restores too, from a version of its own world, not resharded.
    restores = [e for e in events(run, "restore") if e["step"] > 0 and e["time"] > killed]
    assert restores and all(e["resharded"] == (e["writer_world"] == 3) for e in restores), restores
    shrink = [e for e in restores if e["writer_world"] == 3]
    assert shrink and shrink[0] is restores[0] and "peer" in {e["tier"] for e in shrink}, restores
    assert any(e["layout"]["dp"] == 2 for e in events(run, "run_start"))
    restored = restores[0]["step"]
    after = {e["step"]: e["loss"] for e in events(run, "step") if e["rank"] == 0 and e["time"] > restores[0]["time"]}
    assert min(after) == restored + 1 and max(after) == STEPS
    for step in set(after) & set(before):  # same samples, another dp: equal up to reduction order
        assert after[step] == pytest.approx(before[step], rel=1e-4), step
    assert after[restored + 1] == pytest.approx(before.get(restored + 1, before[restored]), rel=0.1)
