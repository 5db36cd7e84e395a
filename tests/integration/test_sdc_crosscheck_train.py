"""The sampled cross-device replay in the demo trainer, with no sdc knob set: a device
whose attention output is persistently wrong (a sign flip on every forward) is found at
the first sampled step after the fault begins (the period printed at start: within
``sdc.cross_check_max_period`` steps at most) and attributed to its rank with three ranks;
a transient flip on a sampled step is replayed away and the run ends bitwise equal to its
fault-free twin."""

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
