"""The agent with real processes, a real etcd and real signals: worker
crashes, hangs, lost nodes, joining nodes."""

from __future__ import annotations

import os
import signal

import pytest

from launchutil import REPO, Agent, events, run_launch, steps_done, tiny_overrides, wait_for, worker_pids


DEMO = REPO / "configs" / "demo.toml"
pytestmark = pytest.mark.slow


def agent_overrides(corpus, steps, **extra):
    return tiny_overrides(corpus, steps, **{"launch.heartbeat_timeout": 4.0, **extra})


def test_worker_kill_is_recovered(corpus, tmp_path, etcd):
    run = tmp_path / "run"
    run.mkdir()
    agent = Agent(DEMO, run, agent_overrides(corpus, 400), "n0", endpoint=etcd.endpoint, nproc=2)
    try:
        wait_for(lambda: steps_done(run) >= 3, 120, "the first steps")
        victim = worker_pids(run)[1]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(events(run, "workers_started")) >= 2, 60, "the restart")
        started = events(run, "workers_started")
        assert started[1]["warm"] == 2, "the restart should use the warm spares"
        # The victim's peer may exit too (its collective broke) and be reaped first: the
        # zygote reports exits in the order it reaps them, not the order they died.
        fail = [e for e in events(run, "failure") if e["kind"] == "exit" and e["pid"] == victim]
        assert fail and fail[0]["exitcode"] == -signal.SIGKILL
        wait_for(lambda: any(e["time"] > started[1]["time"] for e in events(run, "step")), 60,
                 "a step after the restart")
        assert len(events(run, "rendezvous")) >= 2
        # Workers forked from the zygote (started before the config was read) still get the
        # node's thread count: one intra-op thread per core each worker shares.
        want = max(1, (os.cpu_count() or 1) // 2) if not os.environ.get("OMP_NUM_THREADS") else int(os.environ["OMP_NUM_THREADS"])
        assert {e["threads"] for e in events(run, "run_start")} == {want}
    finally:
        agent.close()


def test_hung_worker_is_detected_and_replaced(corpus, tmp_path, etcd):
    run = tmp_path / "run"
    run.mkdir()
    agent = Agent(DEMO, run, agent_overrides(corpus, 400), "n0", endpoint=etcd.endpoint, nproc=2)
    try:
        wait_for(lambda: steps_done(run) >= 3, 120, "the first steps")
        victim = worker_pids(run)[0]
        os.kill(victim, signal.SIGSTOP)
        timeout = wait_for(lambda: events(run, "heartbeat_timeout"), 60, "the hang to be detected")[0]
        assert timeout["pid"] == victim and timeout["seconds_since_beat"] >= 4.0
        wait_for(lambda: len(events(run, "workers_started")) >= 2, 60, "the replacement")
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except (ProcessLookupError, UnboundLocalError):
            pass
        agent.close()


def test_node_loss_shrinks_and_a_new_node_grows(corpus, tmp_path, etcd):
    """Two nodes train; one is killed (agent and workers) → the survivor
    re-forms alone; a new node joins → the job grows back to two; that node is
    preempted (SIGTERM) → the survivor re-forms alone from the step both saved."""
    run = tmp_path / "run"
    run.mkdir()
    over = agent_overrides(corpus, 2000)
    a = Agent(DEMO, run, over, "a", nnodes="1:2", endpoint=etcd.endpoint, nproc=1)
    b = Agent(DEMO, run, over, "b", nnodes="1:2", endpoint=etcd.endpoint, nproc=1)
    c = None
    try:
        wait_for(lambda: any(len(e["nodes"]) == 2 for e in events(run, "rendezvous")), 120, "a 2-node round")
        wait_for(lambda: steps_done(run) >= 3, 120, "the first steps")
        b.kill_node()
        wait_for(lambda: any(e["nodes"] == ["a"] and e["node"] == "a" for e in events(run, "rendezvous")),
                 90, "the survivor to re-form alone")
        n_steps = len(events(run, "step"))
        wait_for(lambda: len(events(run, "step")) > n_steps + 2, 90, "steps on one node")
        assert any(e["layout"]["world"] == 1 for e in events(run, "run_start"))
        c = Agent(DEMO, run, over, "c", nnodes="1:2", endpoint=etcd.endpoint, nproc=1)
        wait_for(lambda: any(sorted(e["nodes"]) == ["a", "c"] for e in events(run, "rendezvous")),
                 120, "the new node to be admitted")
        wait_for(lambda: any(e["layout"]["world"] == 2 and e["time"] > c_start for e in events(run, "run_start"))
                 if (c_start := min(e["time"] for e in events(run, "agent_start") if e["node"] == "c")) else False,
                 120, "training on two nodes again")
        # c is preempted (SIGTERM to its agent): every rank saves the same last step, c leaves,
        # and a re-forms alone from that step, its workers' stop not counted as a failure
        two = max(e["time"] for e in events(run, "run_start") if e["layout"]["world"] == 2)
        wait_for(lambda: len([e for e in events(run, "step") if e["time"] > two]) >= 2, 120, "steps on two nodes")
        failures_before = len([e for e in events(run, "failure") if e["node"] == "a"])
        os.kill(c.proc.pid, signal.SIGTERM)
        assert c.wait(90) is not None
        left = wait_for(lambda: [e for e in events(run, "run_end") if e["node"] == "a" and e.get("peer_left")],
                        90, "a's workers to stop for c's preemption")[0]
        assert [e["step"] for e in events(run, "run_end") if e["node"] == "c"] == [left["step"]]
        wait_for(lambda: any(e["node"] == "a" and e.get("start_step") == left["step"] and e["layout"]["world"] == 1
                             for e in events(run, "run_start")), 120, "a to resume alone from the saved step")
        assert any(e.get("reason") == "peer_preempted" for e in events(run, "membership"))
        assert len([e for e in events(run, "failure") if e["node"] == "a"]) == failures_before
    finally:
        for agent in (a, b, c):
            if agent is not None:
                agent.close()


def test_unreachable_etcd_is_a_clear_error(corpus, tmp_path):
    from resilient.etcd import free_port

    proc = run_launch(DEMO, tmp_path / "run", tiny_overrides(corpus, 1), nproc=1, check=False, timeout=60,
                      extra_args=["--rdzv-endpoint", f"127.0.0.1:{free_port()}"])
    assert proc.returncode == 2
    assert "etcd" in proc.stderr and "127.0.0.1" in proc.stderr


def test_ctrl_c_stops_the_node_like_a_preemption(corpus, tmp_path, etcd):
    """SIGINT (Ctrl-C) to the launcher: the workers finish their step and save it
    durably, no worker dies with a KeyboardInterrupt, and the launcher exits 130."""
    run = tmp_path / "run"
    run.mkdir()
    over = agent_overrides(corpus, 400, **{"snapshot.every": 1, "snapshot.durable_every": 1000})
    agent = Agent(DEMO, run, over, "n0", endpoint=etcd.endpoint, nproc=2)
    try:
        wait_for(lambda: steps_done(run) >= 3, 120, "the first steps")
        os.kill(agent.proc.pid, signal.SIGINT)
        assert agent.wait(90) == 128 + signal.SIGINT, agent.output()[-3000:]
        assert [e["signal"] for e in events(run, "preemption")] == [signal.SIGINT]
        assert events(run, "agent_stop")[-1]["reason"] == "interrupted"
        assert not events(run, "worker_error")
        ends = events(run, "run_end")
        assert len(ends) == 2 and all(e["preempted"] for e in ends)
        durable = [e["step"] for e in events(run, "commit") if e["tier"] == "durable"]
        assert durable and max(durable) == ends[0]["step"] >= 3
    finally:
        agent.close()


def test_a_final_snapshot_that_cannot_be_written_fails_the_run(corpus, tmp_path):
    """A run whose last step never became durable must not exit 0: the launcher's
    error says why, naming the workers' own error."""
    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint directory should be")
    over = tiny_overrides(corpus, 3, **{"snapshot.every": 1, "snapshot.durable_url": (blocker / "ckpt").as_uri()})
    proc = run_launch(DEMO, tmp_path / "run", over, nproc=1, check=False, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "training failed: the final state could not be made durable (local rank 0 exit code 76)" in proc.stderr
    assert "the final snapshot of step 3 could not be made durable" in proc.stderr
    assert "a file stands where a directory" in proc.stderr
    assert len(events(tmp_path / "run", "workers_started")) == 1  # no restart: it would fail the same way


def test_a_node_whose_worker_leaves_for_quarantine_admits_nobody_until_it_has(tmp_path):
    """The bad node's worker marks itself before the barrier its peers leave by; until it
    has exited (WorkerExit.QUARANTINE), its agent reports no waiting node, so it cannot restart
    (kill) the worker and lose the exit code (tests/integration/test_sdc_train.py saw the node re-join
    and corrupt the replayed step again). The mark goes with the worker's slot."""
    from datetime import timedelta
    from types import SimpleNamespace

    from resilient.agent.agent import ResilientAgent
    from resilient.agent.heartbeat import HeartbeatMonitor
    from resilient.job.heartbeat import HeartbeatWriter

    monitor = HeartbeatMonitor(tmp_path / "beats", timedelta(seconds=30), timedelta(seconds=60))
    monitor.reset(0)
    agent = SimpleNamespace(failslow=SimpleNamespace(leaving=lambda: False), _handler_nodes_waiting=lambda: 1,
                            _etcd_down_since=None, heartbeats=monitor, procs={0: None})
    assert ResilientAgent._nodes_waiting(agent) == 1
    HeartbeatWriter(monitor.path(0)).mark_quarantine()
    assert monitor.quarantine_marked(0) and ResilientAgent._nodes_waiting(agent) == 0
    monitor.reset(0)   # a new worker in the slot
    assert not monitor.quarantine_marked(0) and ResilientAgent._nodes_waiting(agent) == 1
    # The mark is the verdict itself: a healthy local worker of the same node, leaving by the
    # same barrier with exit 1, may be seen first; the node is quarantined all the same.
    emitted = []
    vars(agent).update(registry=None, quarantined=False, _remaining_restarts=3, procs={0: None, 1: None},
                 settings=SimpleNamespace(node_id="b", run_id="r"),
                 events=SimpleNamespace(emit=lambda kind, **f: emitted.append((kind, f))))
    HeartbeatWriter(monitor.path(0)).mark_quarantine()
    ResilientAgent._quarantine_if_asked(agent, {1: SimpleNamespace(exitcode=1, local_rank=1)})
    assert agent.quarantined and agent._remaining_restarts == 0
    assert emitted == [("quarantine", {"node": "b", "reason": "silent data corruption confirmed by the SDC monitor",
                                       "local_ranks": [0], "device": "b:0"})]


def test_the_heartbeat_deadline_follows_the_jobs_step_time(tmp_path):
    """A worker whose steps take 50 s (checked SDC steps, evals on a loaded host) is not hung
    after 30 s of silence; without such steps behind it, it is (issue 38.5, 41.4). The beats'
    times are set on the real files, not waited for."""
    import os
    import time
    from datetime import timedelta

    from resilient.agent.heartbeat import HeartbeatMonitor

    mon = HeartbeatMonitor(tmp_path, timedelta(seconds=30), timedelta(seconds=300))
    mon.reset(0)
    now = time.time()
    for beat in (now - 250, now - 200, now - 150):   # three steps of 50 s, seen as they came
        open(mon.path(0), "a").close()
        os.utime(mon.path(0), (beat, beat))
        mon.silent_for(0)
    assert mon.deadline(0) == 4 * 50
    assert mon.silent_for(0) is None            # 150 s quiet: within 4 steps of 50 s
    fresh = HeartbeatMonitor(tmp_path / "other", timedelta(seconds=30), timedelta(seconds=300))
    fresh.reset(0)
    open(fresh.path(0), "a").close()
    os.utime(fresh.path(0), (now - 150, now - 150))
    quiet, limit = fresh.silent_for(0)          # no steps measured: the configured 30 s
    assert limit == 30 and quiet >= 150


def test_a_bounded_wait_beats_for_its_bound_and_then_falls_silent(tmp_path):
    """HeartbeatWriter.while_waiting(limit=...): the agent sees beats while the wait is within
    its bound, then silence, so its own deadline judges a wait that outlasts the bound."""
    import os
    import time
    from datetime import timedelta

    from resilient.job.heartbeat import HeartbeatWriter

    path = tmp_path / "worker0.beat"
    writer = HeartbeatWriter(str(path))
    writer.beat()
    os.utime(path, (0, 0))
    start = time.monotonic()
    with writer.while_waiting(every=timedelta(milliseconds=10), limit=timedelta(milliseconds=200)):
        while os.stat(path).st_mtime == 0 and time.monotonic() - start < 60:
            time.sleep(0.01)
        assert os.stat(path).st_mtime > 0          # beating within the bound
        time.sleep(max(0.0, start + 3 - time.monotonic()))
        after_bound = os.stat(path).st_mtime
        time.sleep(1)
        assert os.stat(path).st_mtime == after_bound   # silent past it
