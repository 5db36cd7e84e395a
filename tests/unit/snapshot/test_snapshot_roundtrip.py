"""Single-process round trips through the durable tier (file://): bitwise, extras, retention, coalescing."""

from __future__ import annotations

import importlib
import json
from datetime import timedelta

import pytest
import torch

from resilient.events import EventLog, read_events
from resilient.snapshot import Snapshotter, SnapshotReader, rng_state, set_rng_state
from resilient.snapshot.boxes import Box


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 33, generator=g)
    return {
        "model": {
            "w": w,
            "wt": torch.randn(20, 30, generator=g).t(),  # non-contiguous
            "b16": torch.randn(257, generator=g).bfloat16(),
            "h": torch.randn(5, 6, generator=g).half(),
            "i": torch.randint(-9, 9, (7, 3), generator=g),
            "mask": torch.rand(11, generator=g) > 0.5,
            "scalar": torch.tensor(float(seed)),
            "empty": torch.zeros(0, 4),
        },
        "optim": {"state": {"w": {"exp_avg": torch.randn(64, 33, generator=g), "step": torch.tensor(7.0)}},
                  "param_groups": [{"lr": 0.01 * seed, "betas": [0.9, 0.95], "params": ["w"]}]},
    }


def zeros_like_state(state: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return None
    return z(state)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t


def assert_state_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(raw(a), raw(b))  # bitwise
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_bitwise_round_trip_with_extras(tmp_path, compress):
    url = f"file://{tmp_path}/ck"
    events = EventLog(tmp_path / "events.jsonl")
    state = make_state(1)
    torch.manual_seed(123)
    with Snapshotter(url, events=events, compress=compress, chunk_bytes=1000, part_bytes=4000) as snap:
        assert snap.save(10, state, extra={"rng": rng_state()}, global_extra={"sample": 640})
        assert snap.wait(timedelta(seconds=30))
        assert snap.committed_step == 10
    expected_draw = torch.rand(3)
    torch.manual_seed(0)
    fresh = zeros_like_state(state)
    with Snapshotter(url, events=events) as snap:
        got = snap.restore(fresh)
    assert got.step == 10 and got.global_extra == {"sample": 640} and not got.resharded
    set_rng_state(got.extra["rng"])
    assert torch.equal(torch.rand(3), expected_draw)
    assert_state_equal(state, fresh)
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == ["snapshot", "upload", "commit", "restore"]
    m = SnapshotReader(url).manifest()
    comp = {c.compression for t in m.tensors.values() for c in t.chunks}
    assert ("zstd" in comp) == (compress == "zstd")
    assert len(m.objects) > 1  # several parts


def test_fresh_run_restores_nothing(tmp_path):
    with Snapshotter(f"file://{tmp_path}/none") as snap:
        assert snap.restore(make_state(0)) is None


def test_reader_streams_regions_and_chunks(tmp_path):
    url = f"file://{tmp_path}/ck"
    state = make_state(2)
    with Snapshotter(url, chunk_bytes=512) as snap:
        snap.save(3, state)
    r = SnapshotReader(url)
    assert [v.step for v in r.versions()] == [3]
    m = r.manifest()
    w = m.tensors["model/w"]
    assert w.shape == (64, 33) and w.dtype == "float32" and len(w.chunks) > 4
    region = r.read_region(m, "model/w", Box((10, 5), (7, 20)))
    assert torch.equal(region, state["model"]["w"][10:17, 5:25])
    assert torch.equal(r.read_region(m, "optim/state/w/exp_avg"), state["optim"]["state"]["w"]["exp_avg"])
    assert m.values["optim/param_groups"][0]["betas"] == [0.9, 0.95]
    doc = json.loads((tmp_path / "ck" / "step-000000000003" / "manifest.json").read_text())
    assert doc["format_version"] == 1 and "model/wt" in doc["tensors"]


def test_retention_keeps_last_and_every_mth(tmp_path):
    url = f"file://{tmp_path}/ck"
    events = EventLog(tmp_path / "e.jsonl")
    state = make_state(3)
    with Snapshotter(url, keep_last=2, keep_every=4, events=events) as snap:
        for step in range(1, 10):
            snap.save(step, state)
            snap.wait(timedelta(seconds=30))
    assert SnapshotReader(url).complete_steps() == [4, 8, 9]
    assert any(e["event"] == "gc" for e in read_events(tmp_path / "e.jsonl"))


def test_slow_storage_coalesces_to_newest_with_bounded_buffers(tmp_path):
    importlib.import_module("resilient_chaos.faultyfs")  # registers faulty://
    url = f"faulty::file://{tmp_path}/ck"
    events = EventLog(tmp_path / "e.jsonl")
    state = make_state(4)
    opts = {"faulty": {"latency": timedelta(milliseconds=60)}}
    with Snapshotter(url, storage_options=opts, events=events, keep_last=100) as snap:
        for step in range(1, 21):
            state["model"]["scalar"].fill_(step)
            state["model"]["w"].fill_(step)
            snap.save(step, state)
        snap.wait(timedelta(seconds=60))
        assert snap.committed_step == 20  # the newest is always written
    evs = list(read_events(tmp_path / "e.jsonl"))
    skipped = [e["coalesced"] for e in evs if e["event"] == "snapshot" and e["coalesced"] is not None]
    uploaded = [e["step"] for e in evs if e["event"] == "upload"]
    assert skipped and len(uploaded) < 20 and uploaded == sorted(uploaded)
    fresh = zeros_like_state(state)
    got = Snapshotter(url, storage_options=opts).restore(fresh)
    assert got.step == 20 and fresh["model"]["scalar"].item() == 20
    # Double buffering: no version was overwritten while being written out.
    r = SnapshotReader(url, storage_options=opts)
    for step in r.complete_steps():
        m = r.manifest(step)
        assert r.read_region(m, "model/scalar").item() == step
        assert (r.read_region(m, "model/w") == step).all()


def test_saving_a_step_again_after_a_rollback_replaces_it_whole(tmp_path):
    url = f"file://{tmp_path}/ck"
    state = make_state(5)
    with Snapshotter(url, keep_last=5) as snap:
        snap.save(6, state)
        snap.wait()
        state["model"]["w"].fill_(-1.0)  # rolled back and trained to step 6 again, differently
        snap.save(6, state)
        snap.wait()
    r = SnapshotReader(url)
    assert r.complete_steps() == [6]
    assert (r.read_region(r.manifest(6), "model/w") == -1.0).all()
    assert len({c.object.split("/")[0] for t in r.manifest(6).tensors.values() for c in t.chunks}) == 1
