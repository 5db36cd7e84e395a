"""Fail-slow detection on real processes: three gloo ranks train a plain loop under
``resilient.Job`` (resilient.failslow.drill: gradients averaged with ``dist.all_reduce``,
no timing code in the loop); the chaos harness's duty-cycle injector slows one rank's process from outside
once the run has learnt its baseline. The detector must name that rank, as a device,
within the issue's bound; a clean run must raise nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest

from resilient_chaos.slow import SlowProcess
from launchutil import events
from resilient.failslow.drill import run_drill
from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow

STEPS = 70
INJECT_AT = 15      # after warmup (8) and a few healthy steps


@pytest.fixture(scope="module")
def pool():
    with GlooPool(3, timeout=timedelta(seconds=120), collective_timeout=timedelta(seconds=60)) as p:
        yield p


def test_a_clean_run_raises_no_straggler(pool, tmp_path):
    out = run_drill(pool, tmp_path, STEPS)
    assert [r["stragglers"] for r in out] == [[], [], []]
    assert not events(tmp_path, "straggler")


@pytest.mark.parametrize("factor,bound", [(2.0, 5)])
def test_a_slowed_rank_is_named_as_a_slow_device(pool, tmp_path, factor, bound):
    slow = SlowProcess(pool.procs[1].pid, factor=factor, period=timedelta(milliseconds=10))
    fired: dict = {}

    def inject(step):
        if step >= INJECT_AT and "step" not in fired:
            fired["step"] = step
            slow.inject()

    try:
        out = [r["stragglers"] for r in run_drill(pool, tmp_path, STEPS, inject)]
    finally:
        slow.clear()
    assert "step" in fired, "the run ended before the injection"
    assert slow.achieved_factor > 1.5, f"the injector did not slow the process (x{slow.achieved_factor:.2f})"
    verdicts = events(tmp_path, "straggler")
    assert verdicts, "no straggler event"
    first = verdicts[0]
    assert {(v["cause"], v["slow_rank"]) for v in verdicts} == {("device", 1)}, verdicts
    assert (first["cause"], first["slow_rank"], first["slow_node"]) == ("device", 1, first["node"]), first
    # every rank reached the same verdict at the same step
    assert out[0] == out[1] == out[2] and out[0][0][:2] == ("device", 1), out
    # one step of lag: the timings of a step ride on the next step's exchange
    assert first["step"] - fired["step"] <= bound + 2, (first["step"], fired["step"], first["steps_of_evidence"])
    assert first["decision"]["action"] == "report" and "expected_loss_seconds" in first["decision"]


def probe(rank, world):
    import torch.distributed as dist

    from resilient.failslow.probe import run_probe

    return run_probe(dist.new_group(backend="gloo"), rank, world)


def test_the_probe_finds_a_process_that_is_slow_inside_the_collectives_too(pool):
    """What the monitor runs on a suspected link: a rank stopped half the time (even in its
    collectives, so every rank's waits grew) shows in its own compute, not in a link."""
    from resilient.failslow.probe import judge

    nodes = ["a", "a", "b"]
    clean = judge(*pool.run(probe)[0], nodes)
    assert clean["cause"] == "link" and clean["slow_rank"] is None, clean   # nothing slow: an unlocated link
    with SlowProcess(pool.procs[2].pid, factor=3.0, period=timedelta(milliseconds=10)) as slow:
        verdict = judge(*pool.run(probe)[0], nodes)
    assert slow.achieved_factor > 1.5
    assert (verdict["cause"], verdict["slow_rank"], verdict["slow_node"]) == ("device", 2, "b"), verdict
