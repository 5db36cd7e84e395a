"""A join that waits is never silent (issue 38, item 4): a node of a two-node job started alone
says, every launch.join_progress_interval, which nodes are registered, how many the job needs
and the endpoint, instead of waiting silently up to launch.join_timeout."""

from __future__ import annotations

import pytest

from launchutil import REPO, Agent, wait_for
from resilient.control.claim import peek_owner
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(200)]


def test_a_waiting_join_says_who_is_there_and_who_is_missing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    agent = Agent(EXAMPLE, run, ["launch.join_progress_interval=1"], "a", nnodes="2", nproc=1,
                  script_args=["--steps", "5"])
    try:
        said = wait_for(lambda: [ln for ln in agent.output().splitlines() if "for the rendezvous at" in ln][1:], 150,
                        "two progress lines of the waiting join")
        owner = wait_for(lambda: peek_owner(run), 10, "the run dir's control-plane claim")
        line = said[-1]
        assert f"for the rendezvous at {owner.endpoint}" in line, line
        assert "nodes registered now: a (this one: a)" in line and "the job needs 2 node(s)" in line, line
        assert "launch.join_timeout (600 s)" in line and "Start the missing nodes" in line, line
        assert agent.proc.poll() is None  # still waiting: a progress line, not an end
    finally:
        agent.close()
        reclaim("/dev/shm", default_run_id(run))
