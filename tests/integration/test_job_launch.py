"""A user's FSDP2 script (examples/fsdp2_train.py) under ``resilient launch`` on two
nodes (two agents on loopback, one worker each, a real etcd, real kills), against a
fault-free run of the same layout:

- a killed worker restores from its node's RAM, a killed node (agent and worker)
  from the survivor's RAM (peer tier), a killed job from durable storage; the run
  ends bitwise equal to the fault-free one, and the data loader's position comes
  back exactly (every step trained on the same sample ids, none repeated or skipped);
- a shrink from dp 2 to 1 (a relaunch on one node with one worker) reshards the
  FSDP2 state and continues within tolerance, on the same samples;
- the same script under plain ``torchrun`` (durable tier only): a killed job resumes
  bitwise."""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launchutil import REPO, Agent, digests, events, losses, run_launch, steps_done, wait_for, worker_pids
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.launch import default_run_id
from resilient.snapshot.nodestore import reclaim

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS, MORE = 36, 44
SETS = ["snapshot.every=1", "snapshot.durable_every=4", "snapshot.replicas=1", "launch.heartbeat_timeout=60"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def script(run: Path, steps: int, pace: float = 0.0) -> list[str]:
    return ["--steps", str(steps), "--trace", str(run / "trace.jsonl"), *(["--pace", str(pace)] if pace else [])]


def kept_ids(run: Path) -> dict[tuple[int, int], list[int]]:
    """(step, rank) → sample ids of the attempt that was kept (the last written: a redone
    step is written again after the restore)."""
    out = {}
    for line in (run / "trace.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[(rec["step"], rec["rank"])] = rec["ids"]
    return out


def newest(run: Path, tier: str) -> int:
    return max((e["step"] for e in events(run, "commit") if e.get("tier") == tier), default=-1)


def memory_ahead(run: Path, steps: int) -> bool:
    """At least ``steps`` trained and the newest memory commit (local and peer) a step or
    two past a durable one (durable_every = 4): the next durable version is two or three
    steps away (0.3 s or more at this pace), so a fault now restores from RAM. A restore
    takes the newest committed step, and both tiers commit within ~0.05 s of a step
    (measured), so a kill at any moment could find a durable version newer than the RAM
    ones and rightly restore from it. Two residues, not one: a loaded leader that skips
    versions may commit only every other step."""
    local, peer = newest(run, "local"), newest(run, "peer")
    return steps_done(run) >= steps and peer % 4 in (1, 2) and local >= peer > newest(run, "durable")


def restores(run: Path) -> set[tuple[str, str]]:
    return {(e["node"], e["tier"]) for e in events(run, "restore") if e["step"] > 0}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The fault-free run: one node, two workers. Every run of the module uses one intra-op
    thread per worker: the thread count a node gives its workers (cores / workers) would
    differ between one node of two workers and two nodes of one, and so would the bits."""
    # The nodes of one job share its secret (the agents on an external etcd need it given).
    env = {"OMP_NUM_THREADS": "1", "RESILIENT_JOB_SECRET": secrets.token_hex(32)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run = tmp_path_factory.mktemp("ref")
        run_launch(EXAMPLE, run, SETS, nproc=2, script_args=script(run, STEPS))
        yield run, digests(run)   # the digests at STEPS (the shrink case trains it on)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_worker_node_and_job_kills_restore_from_ram_peer_and_durable_bitwise(ref, tmp_path):
    ref, ref_digests = ref
    run = tmp_path / "run"
    run.mkdir()
    args = script(run, STEPS, pace=0.15)
    agents: list[Agent] = []

    def node(name: str, domain: str) -> Agent:
        agents.append(Agent(EXAMPLE, run, SETS, name, nnodes="2", endpoint=etcd.endpoint, nproc=1,
                            extra_args=["--domain", domain], script_args=args))
        return agents[-1]

    with embedded_etcd() as etcd:
        try:
            a, b = node("a", "r1"), node("b", "r2")
            wait_for(lambda: memory_ahead(run, 6), 300, "the first steps")
            os.kill(worker_pids(run, "a")[0], signal.SIGKILL)           # a worker: node RAM
            wait_for(lambda: ("a", "local") in restores(run), 120, "a restore from node RAM")
            wait_for(lambda: memory_ahead(run, 14), 300, "steps after the worker's restart")
            b.kill_node()                                                # a node: peer RAM
            c = node("c", "r3")
            wait_for(lambda: ("c", "peer") in restores(run), 120, "a restore from the peer's RAM")
            wait_for(lambda: steps_done(run) >= 22, 300, "steps after the node's replacement")
            a.kill_node()                                                # the whole job: durable
            c.kill_node()
            d, e = node("d", "r1"), node("e", "r2")
            assert d.wait(300) == 0, d.output()[-3000:]
            assert e.wait(300) == 0, e.output()[-3000:]
        finally:
            for agent in agents:
                agent.close()
            reclaim("/dev/shm", default_run_id(run))
    got = restores(run)
    assert {("a", "local"), ("c", "peer"), ("d", "durable"), ("e", "durable")} <= got, got
    assert digests(run) == ref_digests and len(ref_digests) == 2, "final state differs from the fault-free run"
    ids = kept_ids(run)
    assert ids == kept_ids(ref), "a step trained on other samples than in the fault-free run"
    flat = [i for s in range(1, STEPS + 1) for r in (0, 1) for i in ids[(s, r)]]
    assert len(flat) == len(set(flat)) == STEPS * 8, "a sample was repeated or skipped"

    # Shrink: the same job relaunched on one node with one worker (dp 2 -> 1) goes on
    # from the newest durable version, resharded; the fault-free run goes on with two.
    run_launch(EXAMPLE, run, SETS, nproc=1, script_args=script(run, MORE))
    run_launch(EXAMPLE, ref, SETS, nproc=2, script_args=script(ref, MORE))
    (shrunk,) = [e for e in events(run, "restore") if e["step"] == STEPS and e.get("resharded")]
    assert shrunk["tier"] == "durable"
    mine, theirs = losses(run), losses(ref)
    for s in range(STEPS + 1, MORE + 1):
        assert math.isclose(mine[s], theirs[s], rel_tol=1e-3), (s, mine[s], theirs[s])
    ids, ref_ids = kept_ids(run), kept_ids(ref)
    for s in range(STEPS + 1, MORE + 1):
        assert ids[(s, 0)] == ref_ids[(s, 0)] + ref_ids[(s, 1)], f"step {s} saw other samples after the shrink"


def test_under_plain_torchrun_a_killed_job_resumes_from_durable(ref, tmp_path):
    env = dict(os.environ, RESILIENT_RUN_DIR=str(tmp_path), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--log-dir={tmp_path / 'torchelastic'}", str(EXAMPLE)]   # not a new /tmp/torchelastic_* per run
    log = open(tmp_path / "torchrun.log", "w")
    first = subprocess.Popen(cmd + script(tmp_path, STEPS, pace=0.1), cwd=tmp_path, env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: steps_done(tmp_path) >= 14, 300, "steps under torchrun")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    second = subprocess.run(cmd + script(tmp_path, STEPS), cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=300)
    log.close()
    assert second.returncode == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    (start,) = [e for e in events(tmp_path, "run_start") if e["rank"] == 0][-1:]
    assert start["tiers"] == ["durable"] and start["start_step"] >= 12
    assert digests(tmp_path) == ref[1]
