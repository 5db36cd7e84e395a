"""The control plane fails too (issue 28): a user's FSDP2 script (examples/fsdp2_train.py)
under ``resilient launch`` with its embedded etcd, real processes, real kills.

- kill -9 of the embedded etcd mid-run: the agent that owns it restarts it on the same
  ports and data, memory-tier commits resume, the run ends bitwise equal to a fault-free
  one, and nothing reads the outage as a preemption;
- two agents on one run dir, the second finding the etcd through the owner record (resilient.control),
  the second one frozen (SIGSTOP) for a moment as the owner of the etcd leaves: the owner
  keeps its etcd up until the other has left, and both exit 0 without error text;
- the owner's wait for the others (:func:`resilient.launch.wait_for_agents_to_leave`) against
  real registry entries: it ends when the last one leaves, or at its bound;
- an external etcd down for longer than ``launch.etcd_outage``: the node stops after its
  workers saved their newest step durably, with a message that says how to resume;
- an external three-member cluster losing two members (no quorum) for a few seconds: the
  job trains through it, commits resume, and it ends bitwise equal to the fault-free run."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import psutil
import pytest

from launchutil import REPO, Agent, digests, events, run_launch, wait_for
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.control.claim import peek_owner
from resilient.launch import LEAVE_WAIT, default_run_id, wait_for_agents_to_leave
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS = 30
SETS = ["snapshot.every=1"]
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(240)]
# What an agent must not print after a successful job (torch's and ours).
ERROR_TEXT = ("error", "Traceback", "could not", "cannot reach")


def script(pace: float = 0.0) -> list[str]:
    return ["--steps", str(STEPS), *(["--pace", str(pace)] if pace else [])]


def etcd_children(pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "etcd"]
    except psutil.NoSuchProcess:
        return []


def committed_steps(run, tier: str = "local") -> list[int]:
    return [e["step"] for e in events(run, "commit") if e["tier"] == tier]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run's final parameter digests (the oracle of the faulted runs)."""
    ref = tmp_path_factory.mktemp("ref") / "run"
    run_launch(EXAMPLE, ref, SETS, nproc=2, script_args=script())
    assert len(digests(ref)) == 2
    return digests(ref)


def test_a_killed_embedded_etcd_is_restarted_and_the_job_ends_as_without_the_fault(tmp_path, reference):
    run = tmp_path / "run"
    run.mkdir()
    agent = Agent(EXAMPLE, run, SETS, "a", nproc=2, script_args=script(pace=0.1))
    try:
        wait_for(lambda: max(committed_steps(run), default=0) >= 5, 120, "the first memory-tier commits")
        (etcd,) = etcd_children(agent.proc.pid)
        killed_at = max(committed_steps(run))
        etcd.kill()
        etcd.wait(10)
        assert agent.wait(180) == 0, agent.output()[-3000:]
        out = agent.output()
    finally:
        agent.close()
        reclaim("/dev/shm", default_run_id(run))
    assert "died (exit code -9); restarted it on the same ports and data" in out, out[-3000:]
    after = [s for s in committed_steps(run) if s > killed_at + 1]
    assert after and max(after) >= STEPS - 1, f"no memory-tier commit after the kill at step {killed_at}"
    assert not events(run, "preemption"), "an etcd outage was read as a preemption"
    assert [e["reason"] for e in events(run, "agent_stop")] == ["finished"]
    assert digests(run) == reference, "final state differs from the fault-free run"


def test_an_external_cluster_that_loses_quorum_is_ridden_through(tmp_path, monkeypatch, reference):
    """Two of three etcd members killed for a few seconds (no quorum: every write fails):
    the workers train on, the memory-tier commits stop and resume once a majority is
    back, and the run ends bitwise equal to the fault-free one, with no preemption."""
    from resilient.etcd.cluster import EtcdCluster

    monkeypatch.setenv("RESILIENT_JOB_SECRET", "5e" * 32)
    run = tmp_path / "run"
    run.mkdir()
    with EtcdCluster(3) as cluster:
        agent = Agent(EXAMPLE, run, SETS, "a", nproc=2, endpoint=cluster.endpoint, script_args=script(pace=0.15))
        try:
            wait_for(lambda: max(committed_steps(run), default=0) >= 5, 120, "the first memory-tier commits")
            cluster.members[1].stop()
            cluster.members[2].stop()
            lost_at = max(committed_steps(run))
            steps_at = len(events(run, "step"))
            wait_for(lambda: len(events(run, "step")) >= steps_at + 3, 60, "steps without quorum")
            cluster.members[1].start()   # a majority again: the quorum is back
            cluster.members[2].start()
            assert agent.wait(180) == 0, agent.output()[-3000:]
        finally:
            agent.close()
            reclaim("/dev/shm", default_run_id(run))
    after = [s for s in committed_steps(run) if s > lost_at + 1]
    assert after and max(after) >= STEPS - 1, f"no memory-tier commit after quorum came back (lost at {lost_at})"
    assert not events(run, "preemption"), "a quorum loss was read as a preemption"
    assert [e["reason"] for e in events(run, "agent_stop")] == ["finished"]
    assert digests(run) == reference, "final state differs from the fault-free run"


def test_nodes_leaving_one_after_the_other_both_exit_cleanly(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    agents: list[Agent] = []
    try:
        a = Agent(EXAMPLE, run, SETS, "a", nnodes="2", nproc=1, script_args=script(pace=0.05))
        agents.append(a)
        wait_for(lambda: peek_owner(run) is not None, 120, "the embedded etcd of the first agent")
        b = Agent(EXAMPLE, run, SETS, "b", nnodes="2", nproc=1, script_args=script(pace=0.05))
        agents.append(b)
        # As the owner leaves (after the exit barrier: both nodes' workers are done), b's agent
        # freezes for less than its lease: it is slow, not gone, and the owner must wait for it.
        wait_for(lambda: any(e["node"] == "a" for e in events(run, "agent_stop")), 180, "the owner's stop",
                 interval=0.02)
        os.kill(b.proc.pid, signal.SIGSTOP)
        b_had_left = any(e["node"] == "b" for e in events(run, "agent_stop"))  # it may be that quick
        time.sleep(2.0)
        assert b_had_left or a.proc.poll() is None, "the owner of the etcd left while another agent was there"
        os.kill(b.proc.pid, signal.SIGCONT)
        code_b = b.wait(60)
        b_left = time.monotonic()
        code_a = a.wait(60)
        a_left = time.monotonic()
        out_a, out_b = a.output(), b.output()
    finally:
        for agent in agents:
            agent.close()
        reclaim("/dev/shm", default_run_id(run))
    assert code_a == 0, out_a[-3000:]
    assert code_b == 0, out_b[-3000:]
    for name, out in (("a", out_a), ("b", out_b)):
        said = [line for line in out.splitlines() if any(t in line for t in ERROR_TEXT)]
        assert not said, f"agent {name} printed error text after a successful job: {said}"
    assert [e["reason"] for e in events(run, "agent_stop")] == ["finished", "finished"]
    # The owner left once b had (not a bound's wait later); a call of b against a dead etcd
    # would have taken the client's retry budget (30 s) and ended in error text.
    assert a_left - b_left < LEAVE_WAIT.total_seconds()


def test_the_owner_waits_for_the_other_agents_to_leave_at_most_its_bound(etcd):
    from resilient.agent.membership import NodeRegistry
    from resilient_chaos.etcd_testing import unique_run_id

    run_id, secret = unique_run_id(), b"s" * 32
    with etcd.client() as client:
        me, other = (NodeRegistry(client, run_id, n, "", timedelta(seconds=30), secret=secret) for n in ("a", "b"))
        me.claim()
        other.claim()
        # Bounded: b stays registered, so the wait ends at its bound, naming b (a, the owner, is not waited for).
        assert wait_for_agents_to_leave(etcd, run_id, "a", timedelta(seconds=0.5)) == ["b"]
        leaving = threading.Timer(0.5, other.leave)
        leaving.start()
        try:
            assert wait_for_agents_to_leave(etcd, run_id, "a", timedelta(seconds=60)) == []
            assert not leaving.is_alive(), "the wait ended before b left"
        finally:
            leaving.join()
            me.leave()


def test_an_external_etcd_down_past_the_outage_bound_stops_the_node_after_a_final_durable_version(
        tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_JOB_SECRET", "5e" * 32)  # the nodes of a job on an external etcd share it
    run = tmp_path / "run"
    run.mkdir()
    sets = [*SETS, "snapshot.durable_every=5", "launch.etcd_outage=3"]
    with embedded_etcd() as etcd:
        agent = Agent(EXAMPLE, run, sets, "a", nproc=2, endpoint=etcd.endpoint,
                      extra_args=["--rdzv-conf", "retry_timeout=1"], script_args=["--steps", "1000", "--pace", "0.1"])
        try:
            wait_for(lambda: max(committed_steps(run), default=0) >= 5, 120, "the first memory-tier commits")
            etcd.stop()
            stopped_at = max(committed_steps(run))
            code = agent.wait(120)
            out = agent.output()
        finally:
            agent.close()
            reclaim("/dev/shm", default_run_id(run))
    assert code == 2, out[-3000:]
    final = max(committed_steps(run, "durable"))
    assert final > stopped_at, "the workers did not save their newest step durably before the node stopped"
    said = out.strip().splitlines()[-1]
    assert f"etcd at {etcd.endpoint} has been unreachable for" in said and "launch.etcd_outage = 3 s" in said, said
    assert f"the newest durable version is step {final}" in said and "Relaunch the same command" in said, said
    assert not events(run, "preemption"), "our own stop was reported as a preemption"
    assert [e["reason"] for e in events(run, "agent_stop")] == ["etcd_outage"]
    # the workers say so too: saved as for a preemption, which it was not (issue 38.4)
    assert "preempted after step" not in out and "stopped by its agent (etcd_outage) after step" in out, out[-3000:]
    ends = events(run, "run_end")
    assert ends and all(e.get("stopped") == "etcd_outage" and not e["preempted"] for e in ends), ends
