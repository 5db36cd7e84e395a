"""SDC checks under pipeline parallelism: pp=2 × dp=2 (4 gloo ranks), the real
training loop (:class:`resilient.gpt.train.Trainer`) on the tiny GPT, with the
1F1B and the interleaved 1F1B schedule (two stages per rank).

A pipeline schedule reduce-scatters each stage's gradients once per step,
after the last micro-batch, and then divides them by the micro-batch count;
the linear check must expect that division (it once did not: every unit of
every rank was a false alarm, and SDC was switched off for pp > 1). Clean runs
raise nothing; a flipped gradient bit is caught within its step, pinned on the
rank that holds it, replayed through the same schedule, and the run ends
bitwise equal to the fault-free one; a parameter flipped at rest is caught
before the next forward and rolled back, bitwise equal too.

One pool of four gloo workers serves the module: the real Trainer runs inside
it (a ``resilient launch`` of four workers costs minutes of start-up on a busy
2-core machine; the loop is the same)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from launchutil import REPO, events, tiny_overrides
from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow

STEPS = 4
SCHEDULES = {
    "1f1b": {"parallel.pp_schedule": "1f1b"},
    "interleaved": {"parallel.pp_schedule": "interleaved-1f1b", "parallel.stages_per_rank": 2},
}
# rank = pp_rank·dp + dp_rank. 1F1B: ranks 2, 3 hold stage 1 (layers 2, 3 and the
# head). Interleaved: ranks 0, 1 hold stages 0 and 2 (layers 0 and 2), so the flip
# lands in the second FSDP root of rank 1.
FLIPS = {
    "1f1b": {"target": "grad", "tensor": "layers.2.attention.wq.weight", "bit": 30, "rank": 3, "step": 2},
    "interleaved": {"target": "grad", "tensor": "layers.2.feed_forward.w2.weight", "bit": 30, "rank": 1, "step": 3},
}


def train(rank, world, overrides, run_dir):
    """One run of the real training loop on this pool rank; its parameter digest."""
    import signal

    from resilient.gpt.config import load_config
    from resilient.job import param_digest
    from resilient.gpt.train import Trainer

    cfg = load_config(REPO / "configs" / "demo.toml", overrides)
    trainer = Trainer(cfg, run_dir, node="pool")
    try:
        assert trainer.layout.as_dict() == {"pp": 2, "dp": 2, "tp": 1, "world": 4}
        assert trainer.job.sdc is not None, "SDC is off with pp > 1"
        trainer.run()
        return param_digest(trainer.model.named_parameters())
    finally:
        trainer.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # the Trainer's handler would outlive it


def _overrides(corpus, schedule: str, *extra: str) -> list[str]:
    return tiny_overrides(corpus, STEPS, **{"parallel.pp": 2, "parallel.dp": 2, "parallel.microbatches": 4,
                                            **SCHEDULES[schedule]}) + list(extra)


def _flip(spec: dict) -> str:
    fields = ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in spec.items())
    return f"sdc.inject=[{{{fields}}}]"


@pytest.fixture(scope="module")
def pool():
    with GlooPool(4, timeout=timedelta(seconds=240), collective_timeout=timedelta(seconds=120)) as p:
        yield p


@pytest.fixture(scope="module")
def clean(pool, corpus, tmp_path_factory):
    """schedule → (run dir, digests) of the fault-free run, computed on first use."""
    runs = {}

    def get(schedule):
        if schedule not in runs:
            run = tmp_path_factory.mktemp(f"pp-clean-{schedule}")
            runs[schedule] = (run, pool.run(train, _overrides(corpus, schedule), str(run)))
        return runs[schedule]
    return get


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_clean_pipeline_run_raises_nothing(clean, schedule):
    run, digests = clean(schedule)
    assert not events(run, "sdc_suspect"), "false positive on a clean pp=2 × dp=2 run"
    assert not events(run, "sdc_verdict") and not events(run, "rollback")
    ends = events(run, "run_end")
    assert len(ends) == 4 and all(e["step"] == STEPS for e in ends)
    assert len(set(digests)) == 4   # four different shards (2 stages × 2 dp shards)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pipeline_grad_flip_is_caught_attributed_and_replayed_away(pool, corpus, clean, tmp_path, schedule):
    spec = FLIPS[schedule]
    run = tmp_path / "flip"
    digests = pool.run(train, _overrides(corpus, schedule, _flip(spec)), str(run))
    (injected,) = events(run, "fault_injected")
    assert injected["rank"] == spec["rank"] and injected["step"] == spec["step"]
    suspects = events(run, "sdc_suspect")
    # within the step, on the rank that holds the flipped gradient, by the exact linear check
    assert suspects and all(s["suspect_rank"] == spec["rank"] and s["step"] == spec["step"] for s in suspects), suspects
    assert any(s["kind"] == "reduction_mismatch" for s in suspects), suspects
    (replay,) = [e for e in events(run, "sdc_replay")]
    assert replay["suspects"] == [spec["rank"]]
    verdicts = events(run, "sdc_verdict")
    assert [(v["suspect_rank"], v["verdict"]) for v in verdicts] == [(spec["rank"], "transient")], verdicts
    assert not events(run, "rollback") and not events(run, "quarantine")
    # the replayed step (same schedule, same batch) healed it: bitwise the fault-free run
    assert digests == clean(schedule)[1]


def test_pipeline_param_flip_at_rest_rolls_back(pool, corpus, clean, tmp_path):
    """A parameter flipped between steps on a last-stage rank is caught before the
    next forward, every rank restores the last version the checks verified and
    trains on through the same schedule: bitwise the fault-free run."""
    spec = {"target": "param", "tensor": "layers.3.feed_forward.w1.weight", "bit": 31, "rank": 2, "step": 2}
    run = tmp_path / "param"
    digests = pool.run(train, _overrides(corpus, "1f1b", "snapshot.durable_every=1", _flip(spec)), str(run))
    suspects = events(run, "sdc_suspect")
    assert suspects and all(s["suspect_rank"] == 2 and s["step"] == 3 and s["kind"] == "param_at_rest"
                            for s in suspects), suspects
    (decided,) = [e for e in events(run, "rollback") if e["rank"] == 0 and "step" in e]   # the monitor's
    (rollback,) = [e for e in events(run, "rollback") if e["rank"] == 0 and "step" not in e]  # the job's
    assert decided["to_step"] in (1, 2)
    # The newest durable version at or below the verified step, committed before the rollback.
    # Not always step 1 or 2: the committer commits the newest version whose ranks all uploaded,
    # so on a loaded host a slow rank's step 1 is passed over for step 2 and the rollback to 1
    # goes back to the initial state (step 0): the same run, a few steps redone.
    committed = [e["step"] for e in events(run, "commit")
                 if e["tier"] == "durable" and e["time"] < rollback["time"] and e["step"] <= decided["to_step"]]
    assert rollback["to_step"] == max(committed, default=0), (committed, rollback)
    assert digests == clean("1f1b")[1]

def test_post_scale_of_the_pipeline_schedules():
    """What the linear check expects a schedule to do to the reduced gradients."""
    from types import SimpleNamespace

    from resilient.sdc.api import SdcError
    from resilient.sdc.reduction import pipeline_post_scale

    assert pipeline_post_scale(None) == 1.0
    assert pipeline_post_scale(SimpleNamespace(scale_grads=True, _n_microbatches=4)) == 0.25
    assert pipeline_post_scale(SimpleNamespace(scale_grads=False, _n_microbatches=4)) == 1.0
    with pytest.raises(SdcError):
        pipeline_post_scale(SimpleNamespace(scale_grads=True))
