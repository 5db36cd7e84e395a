"""A stalled agent is not a lost node (issue 38, item 5; the chaos kind `agent-stall`): two agents
of a user's FSDP2 script, one agent (alone, its worker trains on) SIGSTOPped in bursts longer
than the node lease (launch.node_lease_ttl, 3 s) yet shorter than the loss-confirmation bound
(launch.loss_confirm_bound, 60 s), as a loaded host stalls it. Its lease lapses but its pid lives
and its port accepts: no second signal, so no `node_lost` failure; both finish, steps contiguous."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from chaos.slow import AgentStall
from launchutil import REPO, Agent, events, wait_for
from resilient.control.claim import peek_owner
from resilient.launch import default_run_id, loss_confirm_bound
from resilient.runconfig import LaunchConfig
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
SETS = ["snapshot.every=5", "snapshot.durable_every=1000"]
STALL, RUN, BURSTS = timedelta(seconds=5), timedelta(seconds=1), 2
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]


def test_agent_stall_bursts_do_not_lose_the_node(tmp_path):
    ttl = LaunchConfig().node_lease_ttl
    # The bursts must mean something: the lease lapses in each, the loss bound is never reached.
    assert timedelta(seconds=ttl) < STALL < loss_confirm_bound(ttl)
    run = tmp_path / "run"
    run.mkdir()
    agents: list[Agent] = []
    try:
        agents.append(Agent(EXAMPLE, run, SETS, "a", nnodes="2", nproc=1, script_args=["--steps", "150", "--pace", "0.1"]))
        wait_for(lambda: peek_owner(run), 120, "the embedded etcd of the first agent")
        agents.append(Agent(EXAMPLE, run, SETS, "b", nnodes="2", nproc=1, script_args=["--steps", "150", "--pace", "0.1"]))
        a, b = agents
        wait_for(lambda: [e for e in events(run, "step") if e["rank"] == 0], 180, "the first step")
        stall = AgentStall(b.proc.pid, stall=STALL, run=RUN, target="node:b", fault_id="stall-b")
        record = stall.inject()
        assert record.status == "injected", record
        time.sleep(BURSTS * (STALL + RUN).total_seconds())
        stall.clear()
        # The bursts came while training (the run had steps left), and a lease lapsed in them.
        assert max(e["step"] for e in events(run, "step")) < 150
        assert "lease" in b.output() and "expired" in b.output(), b.output()[-3000:]
        assert stall.stopped_seconds >= BURSTS * STALL.total_seconds() * 0.9, stall.stopped_seconds
        assert a.wait(240) == 0, a.output()[-3000:]
        assert b.wait(120) == 0, b.output()[-3000:]
        lost = [e for e in events(run, "failure") if e.get("kind") == "node_lost"]
        assert not lost, lost
        steps = sorted({e["step"] for e in events(run, "step") if e["rank"] == 0})
        assert steps == list(range(steps[0], steps[0] + len(steps))) and steps[-1] == 150, steps
    finally:
        for agent in agents:
            agent.close()
        reclaim("/dev/shm", default_run_id(run))
