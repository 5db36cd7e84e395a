"""The control plane leaves with its node (issue 38, items 3 and 4): two agents of a user's
FSDP2 script on one run dir, the first owning the embedded etcd, no durable version yet. kill -9
of the first agent's process group (agent, worker, its etcd) at a step: the other node stops at
once with a typed message that names the lost node and what to relaunch, after making its newest
whole version durable from its RAM store (its own shards and the lost node's replica); never a
preemption, no traceback of ours. A relaunch of both resumes from a step at least the one
committed before the kill, not step 0. Then the relaunched owner is preempted (SIGTERM): the
other, re-joining as its etcd goes, stops with the same typed message, not a rendezvous error."""

from __future__ import annotations

import signal

import pytest

from launchutil import REPO, Agent, events, wait_for
from resilient.control.claim import peek_owner
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
# Memory versions every step, replicated to the other node; durable only far past the kill.
SETS = ["snapshot.every=1", "snapshot.durable_every=1000"]
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]


def memory_commits(run) -> list[int]:
    return [e["step"] for e in events(run, "commit") if e["tier"] in ("local", "peer")]


def endpoint_of(run) -> str:
    """The endpoint in the run dir's control-plane claim while its owner lives (else "")."""
    owner = peek_owner(run)
    return owner.endpoint if owner else ""


def test_losing_the_agent_that_owns_the_etcd_keeps_what_was_committed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    agents: list[Agent] = []

    def start(node: str, steps: int = 40) -> Agent:
        agents.append(Agent(EXAMPLE, run, SETS, node, nnodes="2", nproc=1,
                            script_args=["--steps", str(steps), "--pace", "0.1"]))
        return agents[-1]

    try:
        a = start("a", 40)
        wait_for(lambda: endpoint_of(run), 120, "the embedded etcd of the first agent")
        first_endpoint = endpoint_of(run)
        b = start("b", 40)
        wait_for(lambda: len([s for s in memory_commits(run) if s >= 3]) >= 2, 180, "replicated memory commits")
        committed = max(e["step"] for e in events(run, "commit") if e["tier"] == "peer")
        a.kill_node()
        assert b.wait(150) == 2, b.output()[-3000:]
        said = b.output().strip().splitlines()[-1]
        # Typed, naming the lost node and the relaunch; not a traceback, not a preemption.
        assert said.startswith("resilient launch: error: node(s) 'a' of this run are gone"), said
        assert "Relaunch every node of the run" in said and "nodes a, b" in said, said
        assert "Traceback" not in b.output().split("resilient launch: error:")[-1]
        stops = [e["reason"] for e in events(run, "agent_stop") if e["node"] == "b"]
        assert stops == ["control_plane_lost"], stops
        assert not events(run, "preemption")
        durable = [e["step"] for e in events(run, "commit") if e["tier"] == "durable"]
        assert durable and max(durable) >= committed, f"committed {committed} in RAM, durable {durable}"
        assert f"step {max(durable)}" in said, said

        # The relaunch of both nodes (the second once the first's new etcd is up).
        a2 = start("a", 400)
        wait_for(lambda: endpoint_of(run) not in ("", first_endpoint), 120, "the relaunched first agent's etcd")
        b2 = start("b", 400)
        wait_for(lambda: len(events(run, "restore")) >= 2, 180, "the relaunch's restores")
        restored = [e["step"] for e in events(run, "restore")]
        assert min(restored) >= committed, f"committed {committed} before the kill, restored {restored}"

        # Now the owner is preempted (SIGTERM to its agent): it saves and, its wait for the
        # others over, takes its etcd with it while b re-joins. b says so, typed, as above.
        wait_for(lambda: max(memory_commits(run)) >= max(restored) + 2, 180, "steps after the relaunch")
        a2.proc.send_signal(signal.SIGTERM)
        assert a2.wait(120) == 128 + signal.SIGTERM, a2.output()[-3000:]
        assert b2.wait(150) == 2, b2.output()[-3000:]
        said = b2.output().strip().splitlines()[-1]
        assert said.startswith("resilient launch: error: node(s) 'a' of this run are gone"), said
        stops = [e["reason"] for e in events(run, "agent_stop")]
        assert stops[-2:] == ["preempted", "control_plane_lost"], stops
    finally:
        for agent in agents:
            agent.close()
        reclaim("/dev/shm", default_run_id(run))
