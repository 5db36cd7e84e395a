"""No node is special, even without an external etcd (issue 38, item 2): three agents of a
user's FSDP2 script on one run dir (two active, one standby) and no --rdzv-endpoint. The
first agent's embedded etcd grows into a three-member cluster as the others join. kill -9 of
the first agent's process group and of the etcd member it started, and its data dir deleted
(a lost machine): the other two finish, bitwise equal to the fault-free run; the lost machine's
replacement, launched on the run dir as the first agent was, takes over its stale claim and
joins the cluster that outlived it (its sealed members record), as a standby."""

from __future__ import annotations

import os
import time
import secrets
import shutil
import signal

import pytest

from launchutil import REPO, Agent, digests, events, run_launch, steps_done, wait_for
from resilient.control.claim import peek_owner
from resilient.control.plane import AUTO_SYNC
from resilient.etcd.server import etcd_started_by
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS = 110   # enough left after the kill for the replacement to join before the end
SETS = ["snapshot.every=1", "snapshot.durable_every=1000", "snapshot.replicas=1", "launch.heartbeat_timeout=60",
        "launch.etcd_members=3"]
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(420)]


@pytest.fixture
def shared_secret(monkeypatch):
    # One intra-op thread per worker in both runs: one node of two workers and two of one
    # would otherwise differ in threads, and so in bits (tests/integration/test_job_launch.py).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RESILIENT_JOB_SECRET", secrets.token_hex(32))


def test_first_agent_lost_with_its_etcd_member_and_data_the_others_finish_bitwise(tmp_path, shared_secret):
    ref = tmp_path / "ref"
    run_launch(EXAMPLE, ref, SETS, nproc=2, script_args=["--steps", str(STEPS)])
    run = tmp_path / "run"
    run.mkdir()
    agents: dict[str, Agent] = {}

    def start(node: str) -> Agent:
        agents[node] = Agent(EXAMPLE, run, SETS, node, nnodes="2", nproc=1,
                             script_args=["--steps", str(STEPS), "--pace", "0.2"])
        return agents[node]

    try:
        a = start("a")
        wait_for(lambda: peek_owner(run), 120, "the first agent's embedded etcd")
        wait_for(lambda: "the job depends on this first agent" in a.output(), 60, "a's banner")
        b = start("b")
        wait_for(lambda: "joined the run dir's etcd cluster as a learner" in b.output(), 120, "b's learner member")
        c = start("c")   # the standby: a and b form the round of two
        wait_for(lambda: "as a voting member (3 of 3)" in c.output(), 120, "c's voting member")
        wait_for(lambda: steps_done(run) >= 4 and [e for e in events(run, "commit") if e["tier"] == "peer"],
                 180, "replicated memory commits")
        # Every client follows the members every AUTO_SYNC (5 s) on its next request (lease
        # keep-alives: each second): a kill right after the third member joined could find a
        # client that knows only the first one. Three intervals of margin.
        time.sleep(3 * AUTO_SYNC.total_seconds())
        assert steps_done(run) < STEPS - 5, "the run ended before the fault: raise STEPS or --pace"
        etcds = etcd_started_by(a.proc.pid)
        assert len(etcds) == 1, f"the first agent's etcd member: {etcds}"
        (etcd_pid, data), = etcds
        a.kill_node()
        try:
            os.kill(etcd_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass   # gone with its agent already (pdeathsig)
        shutil.rmtree(data.parent if data.name == "data" else data)   # its data dir, log and all
        # The lost machine's replacement, launched as the first one was: the run dir's claim names
        # a dead owner, its sealed members record the cluster that lives on in b and c. It must
        # join that cluster (a standby), never start a second etcd the others cannot see.
        d = start("d")
        wait_for(lambda: "outlived the agent that started it; this agent joins it" in d.output(), 120,
                 "the replacement joining the surviving cluster")
        assert "with client TLS and authentication" not in d.output(), d.output()[-3000:]   # no etcd of its own
        assert b.wait(300) == 0, b.output()[-3000:]
        assert c.wait(120) == 0, c.output()[-3000:]
        assert d.wait(120) == 0, d.output()[-3000:]
        stops = {e["node"]: e["reason"] for e in events(run, "agent_stop")}
        assert stops.get("b") == "finished" and stops.get("c") == "finished", stops
        assert "removed etcd member" in b.output() + c.output() + d.output(), d.output()[-3000:]   # the dead member left
    finally:
        for agent in agents.values():
            agent.close()
        reclaim("/dev/shm", default_run_id(run))
    assert digests(run) == digests(ref) and len(digests(ref)) == 2, "final state differs from the fault-free run"
