"""The durable tier against a real S3 API: moto's server on loopback, through s3fs.

Credentials and region come from the environment, as on a real fleet; only
the endpoint is passed in ``client_kwargs``. The server listens on a port the
kernel picks (port 0) and is stopped at the end.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from resilient.events import EventLog, read_events
from resilient.snapshot import RetryPolicy, Snapshotter, SnapshotReader

pytest.importorskip("s3fs")


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(300, 200, generator=g), "h": torch.randn(4000, generator=g).bfloat16()},
            "step": step}


def blank() -> dict:
    return {"model": {"w": torch.zeros(300, 200), "h": torch.zeros(4000, dtype=torch.bfloat16)}, "step": 0}


def test_s3_round_trip_compresses_bf16_only(s3_endpoint, tmp_path):
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    url = "s3://ckpt/run1"
    events = EventLog(tmp_path / "e.jsonl")
    with Snapshotter(url, storage_options=opts, events=events, keep_last=2, chunk_bytes=64 << 10) as snap:
        for step in (1, 2, 3):
            snap.save(step, state(step))
            snap.wait(timedelta(seconds=60))
    r = SnapshotReader(url, storage_options=opts)
    assert r.complete_steps() == [2, 3]
    m = r.manifest()
    assert {c.compression for c in m.tensors["model/h"].chunks} == {"zstd"}  # bf16 to a remote link
    assert {c.compression for c in m.tensors["model/w"].chunks} == {"none"}  # fp32 does not pay
    got_state = blank()
    got = Snapshotter(url, storage_options=opts).restore(got_state)
    want = state(3)
    assert got.step == 3 and got_state["step"] == 3
    assert torch.equal(got_state["model"]["w"], want["model"]["w"])
    assert torch.equal(got_state["model"]["h"].view(torch.int16), want["model"]["h"].view(torch.int16))
    assert [e["event"] for e in read_events(tmp_path / "e.jsonl")].count("commit") == 3


def test_flaky_s3_retries_and_never_shows_an_incomplete_version(s3_endpoint, tmp_path):
    from resilient_chaos.faultyfs import FaultPlan
    plan = FaultPlan(error_rate=0.2, torn_write_rate=0.15, latency=timedelta(milliseconds=2), seed=7)
    opts = {"faulty": {"plan": plan},
            "s3": {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}}
    url = "faulty::s3://ckpt/flaky"
    events = EventLog(tmp_path / "e.jsonl")
    retry = RetryPolicy(initial=timedelta(milliseconds=5), deadline=timedelta(seconds=30), attempts=30)
    with Snapshotter(url, storage_options=opts, events=events, keep_last=10, retry=retry,
                     chunk_bytes=32 << 10, part_bytes=128 << 10) as snap:
        for step in (1, 2, 3):
            snap.save(step, state(step))
            assert snap.wait(timedelta(seconds=60))
    assert plan.injected["torn_write"] > 0 and sum(plan.injected.values()) > 3
    plan.enabled = False
    r = SnapshotReader(url, storage_options=opts)
    for step in r.complete_steps():  # every visible version is whole and verified
        m = r.manifest(step)
        assert torch.equal(r.read_region(m, "model/w"), state(step)["model"]["w"])
    assert r.complete_steps() == [1, 2, 3]
    evs = list(read_events(tmp_path / "e.jsonl"))
    assert any(e["event"] == "upload_error" and e.get("retrying") for e in evs)
