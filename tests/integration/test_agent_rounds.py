"""Agents whose round breaks: a rank-0 node killed right after its round
completed, and an agent whose rendezvous fails (its stop reason says so)."""

from __future__ import annotations

import pytest

from launchutil import REPO, Agent, events, tiny_overrides, wait_for

DEMO = REPO / "configs" / "demo.toml"
pytestmark = pytest.mark.slow


def _overrides(corpus, steps, **extra):
    # global_batch 6: the job runs on 2 or 3 nodes (one worker each).
    return tiny_overrides(corpus, steps, **{"launch.heartbeat_timeout": 5.0, "launch.last_call_timeout": 3.0,
                                            "train.global_batch": 6, "train.log_every": 100, **extra})


def test_rank0_node_killed_right_after_a_round_completes(corpus, tmp_path, etcd):
    """Three nodes form a round; the node holding group rank 0 (whose worker hosts
    MASTER_ADDR's store) is killed as soon as it reports the round. The other two
    re-form without it and train on, within a bound far below the 300 s store
    and collective timeouts they would otherwise wait out."""
    run = tmp_path / "run"
    run.mkdir()
    over = _overrides(corpus, 100000)
    agents = {n: Agent(DEMO, run, over, n, nnodes="2:3", endpoint=etcd.endpoint, nproc=1) for n in "abc"}
    try:
        first = wait_for(lambda: [e for e in events(run, "rendezvous") if len(e["nodes"]) == 3
                                  and e["group_rank"] == 0], 180, "a 3-node round")[0]
        victim = first["node"]
        agents[victim].kill_node()
        survivors = sorted(set("abc") - {victim})
        after = first["time"]

        def two_node_round():
            return [e for e in events(run, "rendezvous") if e["time"] > after and sorted(e["nodes"]) == survivors]

        rounds = wait_for(two_node_round, 150, f"{survivors} to re-form without {victim}")
        formed = max(e["time"] for e in rounds)
        wait_for(lambda: [e for e in events(run, "step") if e["time"] > formed], 150,
                 "a step after the survivors re-formed")
        stops = [e for e in events(run, "agent_stop") if e["node"] in survivors]
        assert not stops, f"a survivor stopped: {stops}"
    finally:
        for a in agents.values():
            a.close()


def test_agent_stop_says_the_rendezvous_failed(corpus, tmp_path, etcd):
    """An agent whose rendezvous cannot complete (2 nodes needed, 1 came) stops with
    reason rendezvous_failed, not "finished"."""
    run = tmp_path / "run"
    run.mkdir()
    agent = Agent(DEMO, run, _overrides(corpus, 5, **{"launch.join_timeout": 4.0}), "lonely",
                  nnodes="2", endpoint=etcd.endpoint, nproc=1)
    try:
        code = agent.wait(120)
        assert code != 0
        (stop,) = events(run, "agent_stop")
        assert stop["reason"].startswith("rendezvous_failed"), stop
    finally:
        agent.close()


def test_a_node_launched_with_another_job_config_is_refused(corpus, tmp_path, etcd):
    """Two nodes of one run, the second with another learning rate: it stops with a
    ConfigError naming the other node, before joining; the first node's config file is
    left as it was (each config is its own content-addressed file)."""
    run = tmp_path / "run"
    run.mkdir()
    first = Agent(DEMO, run, _overrides(corpus, 5), "a", nnodes="2", endpoint=etcd.endpoint, nproc=1)
    second = None
    try:
        wait_for(lambda: any(e["event"] == "agent_start" for e in events(run)), 120, "node a's agent_start")
        mine = sorted(run.glob("config-*.json"))
        assert len(mine) == 1
        before = mine[0].read_text()
        second = Agent(DEMO, run, _overrides(corpus, 5, **{"train.lr": 0.01}), "b", nnodes="2",
                       endpoint=etcd.endpoint, nproc=1)
        assert second.wait(120) != 0
        out = second.output()
        assert "error:" in out and "['a']" in out and "another job" in out, out[-2000:]
        assert mine[0].read_text() == before
        assert not [e for e in events(run, "agent_start") if e["node"] == "b"]
    finally:
        for agent in (first, second):
            if agent is not None:
                agent.close()
