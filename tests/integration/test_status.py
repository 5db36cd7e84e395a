"""``resilient status`` on a running 2-worker job (its run dir and its etcd, through the
authenticated readers) and on the same run dir once the job has finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from launchutil import REPO, Agent, events, steps_done, tiny_overrides, wait_for, worker_pids

DEMO = REPO / "configs" / "demo.toml"
STEPS = 30


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resilient.cli", "status", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def status_json(*args: str) -> dict:
    proc = status(*args, "--once", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_status_of_a_running_job_and_of_its_finished_run_dir(corpus, tmp_path, etcd):
    run = tmp_path / "run"
    run.mkdir()
    over = tiny_overrides(corpus, STEPS, **{"snapshot.every": 1, "launch.heartbeat_timeout": 60.0})
    agent = Agent(DEMO, run, over, "n0", endpoint=etcd.endpoint, nproc=2, extra_args=["--domain", "rack-a"])
    paused: list[int] = []
    try:
        wait_for(lambda: steps_done(run) >= 3, 120, "the first steps")
        os.kill(worker_pids(run)[1], signal.SIGKILL)  # a failure and a recovery for the view to show
        wait_for(lambda: len(events(run, "workers_started")) >= 2, 60, "the restart")
        restarted = events(run, "workers_started")[-1]["time"]
        wait_for(lambda: any(e["time"] > restarted for e in events(run, "step")), 60, "a step after the restart")
        # ... and what the view is asked to show below: the memory tier's commits lag the steps
        # (the kill may come before step 3's, and the new workers' first one takes a moment)
        wait_for(lambda: max((e["step"] for e in events(run, "commit") if e["tier"] == "local"), default=-1) >= 3,
                 60, "a memory-tier commit of step 3 or later")
        # Hold the job still while it is looked at (the heartbeat timeout is longer than this).
        paused = list(worker_pids(run).values())
        signal_all(paused, signal.SIGSTOP)
        run_id = events(run, "agent_start")[0]["run_id"]

        live = status_json(str(run), "--rdzv-endpoint", etcd.endpoint)
        assert live["state"] == "running" and live["run_id"] == run_id
        assert live["etcd"] == {"endpoint": etcd.endpoint}, live["etcd"]  # read, no error
        (node,) = live["nodes"]
        # the domain and "registered" come from the node's authenticated registry entry in etcd
        assert node["node"] == "n0" and node["domain"] == "rack-a" and node["registered"] is True
        assert node["state"] == "training" and node["ranks"] == [0, 1] and node["step"] >= 3
        assert live["round"]["world"] == 2 and live["round"]["nodes"] == ["n0"]
        assert live["committed"]["local"] >= 3
        assert [f["kind"] for f in live["failures"]] and live["failures"][0]["kind"] == "exit"
        assert live["recoveries"][0]["cause"] == "exit" and live["recoveries"][0]["finished"]
        assert 0 < live["goodput"]["ratio"] < 1 and live["goodput"]["steps_kept"] >= 3

        # etcd alone (no run dir): the registry, commit records and quarantine, with the secret's file
        bare = status_json("--rdzv-endpoint", etcd.endpoint, "--run-id", run_id, "--secret-file", str(run / "job.secret"))
        assert [(n["node"], n["domain"]) for n in bare["nodes"]] == [("n0", "rack-a")]
        assert bare["committed"]["local"] >= 3 and bare["quarantine"] == {}
        # a wrong secret authenticates nothing: the records are left out, never shown
        forged = tmp_path / "other.secret"
        forged.write_text("f" * 64)
        forged.chmod(0o600)
        other = status_json("--rdzv-endpoint", etcd.endpoint, "--run-id", run_id, "--secret-file", str(forged))
        assert other["nodes"] == [] and other["committed"] == {}

        signal_all(paused, signal.SIGCONT)
        paused = []
        assert agent.wait(180) == 0, agent.output()[-3000:]
    finally:
        signal_all(paused, signal.SIGCONT)
        agent.close()

    done = status_json(str(run))
    assert done["state"] == "finished" and done["step"] == STEPS and "etcd" not in done
    assert done["nodes"][0]["state"] == "stopped" and done["nodes"][0]["stopped"] == "finished"
    assert done["committed"]["local"] == STEPS
    g = done["goodput"]
    assert g["steps_kept"] == STEPS  # each step once, whatever was redone after the kill
    assert abs(sum(g["parts_s"].values()) - g["wall_s"]) < 1e-3 and 0 < g["ratio"] < 1
    assert g["by_cause"]["exit"]["incidents"] == 1
    text = status(str(run), "--once")
    assert text.returncode == 0 and "state: finished" in text.stdout and "exit: training again after" in text.stdout
    bad = status("--rdzv-endpoint", etcd.endpoint, "--once")  # no run id, nowhere to find one
    assert bad.returncode == 2 and "--run-id" in bad.stderr


def test_a_running_jobs_etcd_is_found_through_its_members_when_the_owner_is_gone(tmp_path, job_secret):
    """launch.etcd_members = 3 and the owner lost: the job trains on with the other members,
    and status reads them from the run dir's sealed members record (issue 38). A record the
    job's secret did not seal is not followed."""
    import argparse

    from resilient.control.plane import _write_members
    from resilient.commands.status import _etcd_target
    from resilient.secret import JobSecret

    run = tmp_path / "run"
    run.mkdir()
    args = argparse.Namespace(run_id=None, rdzv_endpoint=None, run_dir=str(run), secret_file=None)
    running = {"run_id": "r1", "state": "running"}
    members = [{"clientURLs": ["https://127.0.0.1:2381"]}, {"clientURLs": ["https://127.0.0.1:2383"]},
               {"clientURLs": ["https://127.0.0.1:2385"], "isLearner": True}]
    assert _etcd_target(args, running) is None            # no owner alive, no members record
    _write_members(run, job_secret, members)
    assert _etcd_target(args, running) == ("127.0.0.1:2381,127.0.0.1:2383", "r1")
    assert _etcd_target(args, {**running, "state": "finished"}) is None
    _write_members(run, JobSecret(b"another job's secret, 32 bytes long", "test"), members)
    assert _etcd_target(args, running) is None
