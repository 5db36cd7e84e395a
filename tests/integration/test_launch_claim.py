"""Two agents of one run dir started at the same instant end on one embedded etcd (issue 38, item 1).

The repro of the issue: ``resilient launch ... --nnodes 2 --node-id a`` and ``... b`` on one run
dir, started together, and again over the claim of a killed owner (killed with -9: its
record stays and names an etcd that died with it). Before, each agent could start its own
etcd and both waited in silence past the join timeout. Now: one etcd (one agent says it
runs it, the other that it joined it), one job whose two nodes trained every step once,
both agents exit 0. Real agents, workers and etcd (a user's FSDP2 script,
examples/fsdp2_train.py); the killed owner is a real process killed with SIGKILL while it
holds the claim.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from launchutil import REPO, Agent, events
from resilient.control.claim import peek_owner
from resilient.launch import default_run_id
from resilient.secret import run_dir_secret
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS = 8
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]

# The owner of a run dir's claim, killed with -9 once it published: its agent's etcd would have
# died with it (PR_SET_PDEATHSIG), so the endpoint it names is dead too.
KILLED_OWNER = r"""
import socket, sys, time
from resilient.control.claim import RunDirClaim
from resilient.secret import JobSecret

run_dir, secret_file = sys.argv[1:]
claim = RunDirClaim(run_dir, JobSecret(open(secret_file, "rb").read().strip()))
assert claim.join() is None
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
claim.publish(f"127.0.0.1:{port}")
print(f"127.0.0.1:{port}", flush=True)
time.sleep(300)
"""


def kill_an_owner(run) -> str:
    secret_file = run_dir_secret(run)
    owner = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, str(run), str(secret_file)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        endpoint = owner.stdout.readline().strip()
        assert endpoint and peek_owner(run).endpoint == endpoint
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
    assert json.loads((run / "control" / "etcd.json").read_text())["endpoint"] == endpoint  # left behind
    assert peek_owner(run) is None
    return endpoint


@pytest.mark.parametrize("over", ["a fresh run dir", "a killed owner's claim"])
def test_two_agents_started_together_share_one_etcd_and_finish(tmp_path, monkeypatch, over):
    monkeypatch.delenv("RESILIENT_JOB_SECRET", raising=False)     # the run dir's job.secret, as on one machine
    monkeypatch.delenv("RESILIENT_JOB_SECRET_FILE", raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    stale = kill_an_owner(run) if over != "a fresh run dir" else None
    trace = run / "trace.jsonl"
    args = ["--steps", str(STEPS), "--trace", str(trace)]
    agents = [Agent(EXAMPLE, run, [], node, nnodes="2", nproc=1, script_args=args) for node in ("a", "b")]
    try:
        codes = [agent.wait(240) for agent in agents]
        outs = [agent.output() for agent in agents]
    finally:
        for agent in agents:
            agent.close()
        reclaim("/dev/shm", default_run_id(run))
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    said = "\n".join(outs)
    assert said.count("resilient: embedded etcd at") == 1, said[-4000:]
    assert said.count("resilient: joined the embedded etcd at") == 1, said[-4000:]
    started = events(run, "agent_start")
    assert sorted(e["node"] for e in started) == ["a", "b"]
    assert len({e["endpoint"] for e in started}) == 1, started
    assert stale not in {e["endpoint"] for e in started}
    # One job of two nodes: every step trained once by each of the two ranks, none twice.
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in lines) == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    assert {r["world"] for r in lines} == {2}
    assert not (run / "control" / "etcd.json").exists(), "the owner left its record behind"
