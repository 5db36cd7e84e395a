"""Checksummed GEMMs on a user's FSDP2 model (two gloo ranks, examples/toy.py's transformer,
``fully_shard`` over both, ``resilient.Job`` around the loop: test_job_fsdp2's loop). Inside
the forward the hooks see FSDP2's all-gathered weight; one Linear's output off by ×4 on
rank 1 (exponent bit 24) is a ``gemm_mismatch`` on rank 1 only, replayed away: the run ends
bitwise equal to the fault-free one, and the clean run raises nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_job_fsdp2 import train

from launchutil import events
from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow


def test_a_gemm_fault_on_one_rank_is_named_and_replayed_away_bitwise(tmp_path):
    spec = 'sdc.inject=[{target="activation", tensor="layers.1.linear2", bit=24, element=5, rank=1, step=6}]'
    every = "sdc.abft_every=1"
    with GlooPool(2, timeout=timedelta(seconds=120), collective_timeout=timedelta(seconds=60)) as pool:
        clean = pool.run(train, str(tmp_path / "clean"), every)
        flipped = pool.run(train, str(tmp_path / "flip"), every, spec)
    assert not events(tmp_path / "clean", "sdc_suspect")
    suspects = events(tmp_path / "flip", "sdc_suspect")
    assert suspects and {(s["suspect_rank"], s["step"], s["kind"]) for s in suspects} == {(1, 6, "gemm_mismatch")}
    assert {s["tensor"] for s in suspects} == {"0:layers.1.linear2:forward"}, suspects
    assert [(v["suspect_rank"], v["verdict"]) for v in events(tmp_path / "flip", "sdc_verdict")] == [(1, "transient")]
    assert flipped == clean, "the replayed run differs from the fault-free run"
