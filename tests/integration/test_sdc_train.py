"""Silent data corruption in the real training loop: a flipped gradient bit
is detected within the step, attributed to its rank, replayed, and the run
ends bitwise equal to a fault-free one; a flipped parameter at rest is caught
at the next step and rolled back to the last clean version; a device that
corrupts every step is quarantined and a spare node takes over."""

from __future__ import annotations

import pytest

from launchutil import REPO, digests, events, losses, run_launch, tiny_overrides

DEMO = REPO / "configs" / "demo.toml"
pytestmark = pytest.mark.slow


def flip(target: str, tensor: str, bit: int, rank: int, step: int) -> str:
    return f'sdc.inject=[{{target="{target}", tensor="{tensor}", bit={bit}, rank={rank}, step={step}}}]'


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("sdc") / "clean"
    run_launch(DEMO, run, tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1}), nproc=2)
    assert not events(run, "sdc_suspect"), "false positive on a clean run"
    return run


def test_checks_change_no_bit_and_the_logged_loss_rides_in_their_exchange(corpus, tmp_path, reference):
    """SDC off: the loop all-reduces the loss for its log; on, it takes the mean of the
    losses the monitor gathered anyway. Same parameters, same logged losses, bit for bit."""
    run = tmp_path / "off"
    run_launch(DEMO, run, tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1, "sdc.enable": False}), nproc=2)
    assert digests(run) == digests(reference)
    assert losses(run) == losses(reference) and len(losses(run)) == 6


def test_gradient_flip_is_replayed_away(corpus, tmp_path, reference):
    run = tmp_path / "grad"
    over = tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1})
    run_launch(DEMO, run, over + [flip("grad", "layers.1.attention.wq.weight", 30, 1, 3)], nproc=2)
    (injected,) = events(run, "fault_injected")
    suspects = events(run, "sdc_suspect")
    assert suspects and all(s["suspect_rank"] == 1 and s["step"] == 3 for s in suspects)
    assert [v["verdict"] for v in events(run, "sdc_verdict")] == ["transient"]
    assert injected["rank"] == 1 and injected["step"] == 3
    assert digests(run) == digests(reference)


def test_parameter_flip_rolls_back(corpus, tmp_path, reference):
    run = tmp_path / "param"
    over = tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1})
    run_launch(DEMO, run, over + [flip("param", "layers.0.feed_forward.w1.weight", 31, 0, 3)], nproc=2)
    suspects = events(run, "sdc_suspect")
    assert suspects and suspects[0]["suspect_rank"] == 0 and suspects[0]["step"] == 4
    # the loop's own record of the rollback it carried out (the monitor's
    # decision event carries the step it was taken at)
    (rollback,) = [e for e in events(run, "rollback") if e["rank"] == 0 and "step" not in e]
    assert 0 < rollback["to_step"] <= 3
    assert digests(run) == digests(reference)


def test_a_flip_before_the_first_step_is_caught(corpus, tmp_path, reference):
    """Between start-up (initialized or restored) and the first optimizer step there
    was no at-rest record: a flip there went unseen and changed the run."""
    run = tmp_path / "first"
    over = tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1})
    spec = 'sdc.inject=[{target="param", tensor="layers.0.attention.wq.weight", bit=31, rank=0, step=0, element=3}]'
    run_launch(DEMO, run, over + [spec], nproc=2)
    assert [(e["step"], e["kind"]) for e in events(run, "sdc_suspect") if e["rank"] == 0] == [(1, "param_at_rest")]
    assert digests(run) == digests(reference)


TRAIL = {"run_start", "step", "commit", "gc", "sdc_suspect", "rollback", "restore", "restore_error", "upload_error",
         "worker_error", "run_end"}


def test_sparse_checks_roll_back_to_the_verified_version_and_abandon_the_rest(corpus, tmp_path, reference):
    """Parameters verified every 2 steps, durable retention of 1 version: a flip after
    step 4 is seen at step 5, when only step 2's state is verified. Retention kept
    version 2 for that (not just the newest), the rollback restores it, and version 4
    (3 went to retention) is deleted, so no later restart can restore a state the check
    never cleared."""
    run = tmp_path / "sparse"
    over = tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1, "snapshot.keep_last": 1,
                                        "sdc.param_check_every": 2, "sdc.state_check_every": 2})
    run_launch(DEMO, run, over + [flip("param", "layers.0.feed_forward.w1.weight", 31, 0, 4)], nproc=2)
    trail = [{k: e[k] for k in ("event", "step", "tier", "removed", "kept", "to_step", "reason", "url") if k in e}
             for e in events(run) if e.get("rank") in (0, None) and e["event"] in TRAIL]
    assert [e["step"] for e in events(run, "sdc_suspect") if e["rank"] == 0] == [5], trail
    (rollback,) = [e for e in events(run, "rollback") if e["rank"] == 0 and "step" not in e]
    assert rollback["to_step"] == 2, trail
    assert [(e["step"], e["tier"]) for e in events(run, "restore") if e["rank"] == 0] == [(2, "durable")]
    (abandoned,) = [e for e in events(run, "gc") if e.get("reason") == "rollback"]
    assert abandoned["removed"] == [4]
    assert digests(run) == digests(reference)


@pytest.mark.timeout(600)
def test_persistent_fault_quarantines_the_node_and_a_spare_takes_over(corpus, tmp_path, reference, monkeypatch):
    """Node b's device corrupts the same gradient at every step from step 3:
    replay says persistent, b is quarantined (in etcd) and leaves, the spare
    node c takes its rank, every rank rolls back to step 2, and the run ends
    bitwise equal to the fault-free one. The fault is pinned to b's hardware
    (``node``), not to a rank: the rank moves on to healthy hardware."""
    import os

    from launchutil import Agent, wait_for
    from resilient.agent.quarantine import Quarantine
    from resilient.etcd import EtcdClient
    from resilient_chaos.etcd_testing import embedded_etcd
    from resilient.launch import default_run_id
    from resilient.secret import RUN_DIR_SECRET, resolve_secret

    # the reference ran 2 workers on one node; give these 1-worker nodes the
    # same intra-op thread count so the arithmetic is the same
    if not os.environ.get("OMP_NUM_THREADS"):
        monkeypatch.setenv("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
    run = tmp_path / "persistent"
    run.mkdir()
    steps = 6
    over = tiny_overrides(corpus, steps, **{"snapshot.durable_every": 1}) + [
        'sdc.inject=[{target="grad", tensor="layers.1.attention.wq.weight", bit=30, node="b", step=3, persistent=true}]']
    with embedded_etcd() as etcd:
        agents = {n: Agent(DEMO, run, over, n, nnodes="2:2", endpoint=etcd.endpoint, nproc=1) for n in ("a", "b")}
        try:
            wait_for(lambda: events(run, "rendezvous"), 180, "the first round")
            agents["c"] = Agent(DEMO, run, over, "c", nnodes="2:2", endpoint=etcd.endpoint, nproc=1)  # the spare
            (q,) = wait_for(lambda: [e for e in events(run, "quarantine") if e["rank"] == -1], 300, "a quarantine")
            assert q["node"] == "b" and q["device"] == "b:0"
            assert agents["b"].wait(60) != 0
            verdicts = events(run, "sdc_verdict")
            assert [v["verdict"] for v in verdicts] == ["persistent"]
            b_rank = next(e["rank"] for e in events(run, "run_start") if e["node"] == "b")
            assert verdicts[0]["suspect_rank"] == b_rank
            with EtcdClient(etcd.endpoint) as client:  # the record authenticates with the run dir's secret
                record = Quarantine(client, default_run_id(run), resolve_secret(run / RUN_DIR_SECRET)).get("b")
            assert record is not None and record["device"] == "b:0"
            for n in ("a", "c"):
                assert agents[n].wait(300) == 0, agents[n].output()[-3000:]
            # final state: a and c finished every step, b did not; the rollback
            # went to the last clean version; the model is the fault-free one
            ends = events(run, "run_end")
            assert {e["node"] for e in ends} == {"a", "c"} and all(e["step"] == steps for e in ends)
            rollbacks = [e for e in events(run, "rollback") if "suspects" in e]
            assert rollbacks and all(e["to_step"] == 2 for e in rollbacks)
            restarts = [e for e in events(run, "run_start") if e["start_step"] > 0]
            assert {e["node"] for e in restarts} == {"a", "c"} and all(e["start_step"] == 2 for e in restarts)
            assert len(events(run, "fault_injected")) == 2  # the step and its replay, both on b
            assert {e["node"] for e in events(run, "fault_injected")} == {"b"}
            assert digests(run) == digests(reference)
            # the quarantined node is refused until an operator clears it
            again = agents["b again"] = Agent(DEMO, run, over, "b", nnodes="2:2", endpoint=etcd.endpoint, nproc=1)
            assert again.wait(120) == 2 and "quarantined" in again.output()
        finally:
            for agent in agents.values():
                agent.close()
