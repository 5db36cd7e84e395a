"""SDC on a user's FSDP2 model through the public API: two gloo ranks, the example's
small transformer (examples/toy.py, not resilient's GPT), ``fully_shard`` over both
ranks, ``resilient.Job`` around the loop.

A flipped gradient bit on one rank is caught by the linear check of FSDP2's
reduce-scatter within its step, pinned on that rank, replayed away: the run ends
bitwise equal to the fault-free one. A parameter flipped at rest is caught
before the next forward and rolled back: bitwise equal too. A block's output
flipped on a sampled step (what no gradient check can see: the device computed
it wrong) is found by the cross-device replay the example's ``batch=`` and
``recompute=`` enable, replayed away: bitwise equal."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest

from launchutil import REPO, events
from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow

STEPS = 14


def train(rank, world, run_dir, *sets, evaluate_every: int = 0):
    """The example's loop (examples/fsdp2_train.py) on this pool rank; its parameter digest."""
    import signal
    import warnings

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(REPO / "examples"))
    from toy import Batches, ResumableSampler, TinyTransformer

    from resilient.job import Job, NotUnderAgent, param_digest
    from resilient.runconfig import load_runtime_config

    class Args:
        global_batch, seed = 8, 0

    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = ResumableSampler(512, 0)
    batches = Batches(model, sampler, Args, rank, world)
    cfg = load_runtime_config(None, ["snapshot.durable_every=1", *sets])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotUnderAgent)
        job = Job(model, opt, state={"sampler": sampler}, run_dir=run_dir, config=cfg, progress=False)
    try:
        for step in job.steps(STEPS):
            loss = batches.forward_backward(step)
            if not job.verify(loss, replay=lambda: batches.forward_backward(step),
                              batch=batches.batch(step), recompute=batches.loss):
                continue
            opt.step()
            opt.zero_grad()
            if evaluate_every and (step + 1) % evaluate_every == 0:
                with torch.no_grad():   # a forward without backward: FSDP2 keeps the root's parameters gathered
                    model(torch.zeros(2, 16, dtype=torch.long))
        return param_digest(model.named_parameters()), job.guard.coverage
    finally:
        job.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(scope="module")
def pool():
    with GlooPool(2, timeout=timedelta(seconds=120), collective_timeout=timedelta(seconds=60)) as p:
        yield p


@pytest.fixture(scope="module")
def clean(pool, tmp_path_factory):
    run = tmp_path_factory.mktemp("clean")
    return run, pool.run(train, str(run))


def test_clean_run_checks_the_reduce_scatters_and_raises_nothing(clean):
    run, results = clean
    assert [c for _, c in results] == ["fsdp-reduce-scatter"] * 2
    assert not events(run, "sdc_suspect") and not events(run, "rollback")
    assert len({d for d, _ in results}) == 2   # two different shards


def test_gradient_flip_is_caught_on_its_rank_and_replayed_away(pool, clean, tmp_path):
    spec = 'sdc.inject=[{target="grad", tensor="layers.1.linear1.weight", bit=30, rank=1, step=6}]'
    results = pool.run(train, str(tmp_path), spec)
    suspects = events(tmp_path, "sdc_suspect")
    assert suspects and all(s["suspect_rank"] == 1 and s["step"] == 6 for s in suspects), suspects
    # after the reduce-scatter: the bits of what the collective delivered no longer add up
    assert {s["kind"] for s in suspects} <= {"reduction_mismatch", "grad_at_rest"}, suspects
    assert [(v["suspect_rank"], v["verdict"]) for v in events(tmp_path, "sdc_verdict")] == [(1, "transient")]
    assert not events(tmp_path, "rollback")
    assert results == clean[1], "the replayed step differs from the fault-free run"


def test_parameter_flip_at_rest_rolls_back(pool, clean, tmp_path):
    spec = 'sdc.inject=[{target="param", tensor="head.weight", bit=31, rank=0, step=4}]'
    results = pool.run(train, str(tmp_path), spec)
    suspects = events(tmp_path, "sdc_suspect")
    assert suspects and all(s["kind"] == "param_at_rest" and s["suspect_rank"] == 0 for s in suspects), suspects
    assert [e for e in events(tmp_path, "rollback") if "step" not in e], "no rollback"
    assert results == clean[1], "the rolled-back run differs from the fault-free run"


def test_a_wrong_block_output_on_a_sampled_step_is_found_by_the_cross_device_replay(pool, clean, tmp_path):
    """Samples every 4 steps (the default period, 34, is past this short run); rank 1's first
    block computes a wrong output in step 8's forward: its neighbour's recompute disagrees
    (two ranks: a tie, both named), the replay on each device heals it."""
    flip = 'sdc.inject=[{target="activation", tensor="layers.0", bit=31, element=3, rank=1, step=8}]'
    results = pool.run(train, str(tmp_path), "sdc.cross_check_max_period=4", flip)
    cross = [e for e in events(tmp_path, "sdc_suspect") if e["kind"] == "cross_check_mismatch"]
    assert {(e["suspect_rank"], e["step"]) for e in cross} == {(0, 8), (1, 8)}, cross
    assert (1, "transient") in {(v["suspect_rank"], v["verdict"]) for v in events(tmp_path, "sdc_verdict")}
    assert not events(tmp_path, "quarantine") and not events(tmp_path, "rollback")
    assert results == clean[1], "the replayed step differs from the fault-free run"


def test_an_evaluation_in_the_loop_body_is_not_a_fault(pool, clean, tmp_path):
    """An evaluation between the optimizer step and the step boundary (the natural place in
    a user's loop) leaves FSDP2's root parameters gathered; the at-rest hashes and the
    snapshot must still see the sharded ones: no suspicion, the same final state."""
    from functools import partial

    results = pool.run(partial(train, evaluate_every=5), str(tmp_path))
    assert not events(tmp_path, "sdc_suspect"), events(tmp_path, "sdc_suspect")[:2]
    assert results == clean[1]
