"""Silent data corruption in the real training loop: a flipped gradient bit
is detected within the step, attributed to its rank, replayed, and the run
ends bitwise equal to a fault-free one; a flipped parameter at rest is caught
at the next step and rolled back to the last clean version."""

from __future__ import annotations

import pytest

from launchutil import REPO, digests, events, run_launch, tiny_overrides

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


@pytest.mark.skip(reason="known failure, issue 7: after the quarantine the re-formed job does not complete")
@pytest.mark.timeout(900)
def test_persistent_fault_quarantines_the_node_and_a_spare_takes_over(corpus, tmp_path):
    from launchutil import Agent, wait_for
    from resilient.etcd.testing import embedded_etcd

    run = tmp_path / "persistent"
    run.mkdir()
    steps = 8
    over = tiny_overrides(corpus, steps, **{"snapshot.durable_every": 1}) + [
        'sdc.inject=[{target="grad", tensor="layers.1.attention.wq.weight", bit=30, rank=1, step=3, persistent=true}]']
    with embedded_etcd() as etcd:
        agents = {n: Agent(DEMO, run, over, n, nnodes="2:2", endpoint=etcd.endpoint, nproc=1) for n in ("a", "b")}
        try:
            wait_for(lambda: events(run, "rendezvous"), 180, "the first round")
            agents["c"] = Agent(DEMO, run, over, "c", nnodes="2:2", endpoint=etcd.endpoint, nproc=1)  # the spare
            (q,) = wait_for(lambda: [e for e in events(run, "quarantine") if e["rank"] == -1], 400, "a quarantine")
            bad = q["node"]
            assert agents[bad].wait(60) != 0
            assert [v["verdict"] for v in events(run, "sdc_verdict")][:1] == ["persistent"]
            wait_for(lambda: any(e["step"] == steps for e in events(run, "run_end")), 400, "the run to complete")
            finished = {e["node"] for e in events(run, "run_end")}
            assert bad not in finished and "c" in finished
            # the quarantined node is refused until an operator clears it
            again = Agent(DEMO, run, over, bad, nnodes="2:2", endpoint=etcd.endpoint, nproc=1)
            assert again.wait(120) == 2 and "quarantined" in again.output()
            again.close()
        finally:
            for agent in agents.values():
                agent.close()
