"""The sampled checks of what devices compute in the demo trainer, with no sdc knob set: a
device whose attention output is persistently wrong (a sign flip on every forward) is found
by the cross-device replay at the first sampled step after the fault begins (the period
printed at start: within ``sdc.cross_check_max_period`` steps at most) and attributed to its
rank with three ranks; one whose grad-input GEMM is persistently wrong (the backward: no
forward recompute sees it) is found by the sampled GEMM checks at their first sample after
the fault (their budget set so small that the bound decides the period: a one-element sign
flip is found only where the flipped value exceeds the row's rounding bound, so the sampled
steps, and with them the flipped values, must not depend on the machine's measured cost;
the measured schedule is the unit tests'); both quarantined, the state rolled back to before the fault; a transient flip on
a sampled step is replayed away and the run ends bitwise equal to its fault-free twin."""

from __future__ import annotations

import pytest

from launchutil import REPO, digests, events, run_launch, tiny_overrides

DEMO = REPO / "configs" / "demo.toml"
pytestmark = pytest.mark.slow


def _inject(**spec) -> str:
    fields = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v if not isinstance(v, str) else repr(v)}"
                       for k, v in spec.items())
    return f"sdc.inject=[{{{fields}}}]".replace("'", '"')


@pytest.mark.timeout(600)
def test_a_persistently_wrong_attention_output_is_found_and_attributed(corpus, tmp_path):
    run = tmp_path / "persistent"
    over = tiny_overrides(corpus, 36, **{"train.global_batch": 9})
    proc = run_launch(DEMO, run, over + [_inject(target="activation", tensor="layers.1.attention", bit=31,
                                                 element=5, rank=1, step=30, persistent=True)],
                      nproc=3, check=False, timeout=420)
    (start,) = {e["sdc_cross_check"] for e in events(run, "run_start")}
    assert "every 34 steps" in start and "within 50 steps" in start
    assert "cross-device replay every 34 steps" in proc.stderr
    cross = [e for e in events(run, "sdc_suspect") if e["kind"] == "cross_check_mismatch"]
    assert cross and {e["suspect_rank"] for e in cross} == {1} and cross[0]["step"] == 34
    assert cross[0]["evidence"]["attributed"] is True
    assert not [e for e in events(run, "sdc_suspect") if e["step"] < 34], "a check saw it before the sample"
    verdicts = [(v["suspect_rank"], v["verdict"]) for v in events(run, "sdc_verdict")]
    assert (1, "persistent") in verdicts and all(r == 1 for r, v in verdicts if v == "persistent")
    (q,) = [e for e in events(run, "quarantine") if e.get("suspect_rank") is not None]
    assert q["suspect_rank"] == 1
    rollbacks = [e for e in events(run, "rollback") if "to_step" in e and e.get("reason") == "sdc quarantine"]
    assert rollbacks and all(e["to_step"] <= 29 for e in rollbacks)   # before the fault began


@pytest.mark.timeout(600)
def test_a_persistently_wrong_backward_gemm_is_found_by_the_sampled_gemm_checks(corpus, tmp_path):
    """FSDP2 over three ranks: a Linear's grad-input GEMM on rank 1 wrong from step 6."""
    run = tmp_path / "backward"
    over = tiny_overrides(corpus, 60, **{"train.global_batch": 9, "sdc.abft_budget": 1e-9})
    proc = run_launch(DEMO, run, over + [_inject(target="activation_grad", tensor="layers.0.feed_forward.w2",
                                                 bit=31, element=5, rank=1, step=6, persistent=True)],
                      nproc=3, check=False, timeout=420)
    assert "checksummed GEMMs every 50 steps" in proc.stderr
    samples = [e for e in events(run, "sdc_gemm_check") if e["rank"] == 0]
    # the first sample at step 3 (the cost measured, the device found clean), the next a period later
    assert [(e["step"], e["period"], e["mismatches"]) for e in samples] == [(3, 50, 0), (53, 50, 1)], samples
    assert samples[0]["share"] > 0   # measured
    hit, found = 1, 53
    gemm = [e for e in events(run, "sdc_suspect") if e["kind"] == "gemm_mismatch" and not e["harmless"]]
    assert gemm and {(e["suspect_rank"], e["step"]) for e in gemm} == {(1, found)}, gemm
    assert {e["tensor"] for e in gemm} == {"0:layers.0.feed_forward.w2:grad_input"}   # part 0, the module, the GEMM
    assert not [e for e in events(run, "sdc_suspect") if e["step"] < found], "a check saw it before the sample"
    (q,) = [e for e in events(run, "quarantine") if e.get("suspect_rank") is not None]
    assert q["suspect_rank"] == 1
    rollbacks = [e for e in events(run, "rollback") if "to_step" in e and e.get("reason") == "sdc quarantine"]
    assert rollbacks and all(e["to_step"] == samples[hit - 1]["step"] for e in rollbacks)   # the last clean sample, before the fault


@pytest.mark.timeout(600)
def test_a_transient_flip_on_a_sampled_step_is_replayed_away_bitwise(corpus, tmp_path):
    over = tiny_overrides(corpus, 5, **{"sdc.cross_check_max_period": 4})
    clean = tmp_path / "clean"
    run_launch(DEMO, clean, over, nproc=2)
    assert not events(clean, "sdc_suspect"), "false alarm on a clean run"
    run = tmp_path / "transient"
    run_launch(DEMO, run, over + [_inject(target="activation", tensor="layers.2.feed_forward", bit=31,
                                          element=3, rank=0, step=4)], nproc=2)
    (injected,) = events(run, "fault_injected")
    assert injected["step"] == 4
    cross = [e for e in events(run, "sdc_suspect") if e["kind"] == "cross_check_mismatch"]
    assert {e["suspect_rank"] for e in cross} == {0, 1} and not any(e["evidence"]["attributed"] for e in cross)
    verdicts = {(v["suspect_rank"], v["verdict"]) for v in events(run, "sdc_verdict")}
    assert (0, "transient") in verdicts and not events(run, "quarantine")   # a tie never quarantines
    assert digests(run) == digests(clean)
