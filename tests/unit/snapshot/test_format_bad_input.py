"""Bad checkpoints: typed errors that name the object, and fallback to the previous complete version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from resilient.events import EventLog, read_events
from resilient.snapshot import (
    FormatVersionError, NoSnapshotFound, SnapshotCorrupt, SnapshotIncomplete, SnapshotMismatch,
    Snapshotter, SnapshotReader,
)


def state_at(step: int) -> dict:
    return {"model": {"w": torch.full((40, 10), float(step)), "b": torch.arange(10.0) + step}}


def blank() -> dict:
    return {"model": {"w": torch.zeros(40, 10), "b": torch.zeros(10)}}


@pytest.fixture
def two_versions(tmp_path) -> tuple[str, Path]:
    url = f"file://{tmp_path}/ck"
    with Snapshotter(url, config_digest="gpt-a", chunk_bytes=400) as snap:
        for step in (1, 2):
            snap.save(step, state_at(step))
            snap.wait()
    return url, tmp_path / "ck" / "step-000000000002"


def data_object(vdir: Path) -> Path:
    return sorted(vdir.glob("*/r00000-p*.bin"))[0]


def restore_with_events(url: str, tmp_path: Path, digest: str = "gpt-a"):
    events = EventLog(tmp_path / "restore.jsonl")
    st = blank()
    got = Snapshotter(url, config_digest=digest, events=events).restore(st)
    return got, st, list(read_events(tmp_path / "restore.jsonl"))


def test_flipped_byte_is_caught_and_falls_back(two_versions, tmp_path):
    url, vdir = two_versions
    obj = data_object(vdir)
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    obj.write_bytes(bytes(raw))
    r = SnapshotReader(url)
    m = r.manifest(2)
    problems = r.verify(m)
    assert len(problems) == 1 and isinstance(problems[0], SnapshotCorrupt) and obj.name in problems[0].obj
    assert r.verify(r.manifest(1)) == []
    with pytest.raises(SnapshotCorrupt) as e:
        for t in m.tensors.values():
            for c in t.chunks:
                r.read_chunk(m, t, c)
    assert obj.name in str(e.value) and obj.name in e.value.obj
    got, st, evs = restore_with_events(url, tmp_path)
    assert got.step == 1 and torch.equal(st["model"]["w"], state_at(1)["model"]["w"])
    fb = [e for e in evs if e["event"] == "restore_fallback"]
    assert fb[0]["step"] == 2 and fb[0]["error_type"] == "SnapshotCorrupt" and obj.name in fb[0]["obj"]


def test_truncated_chunk_falls_back(two_versions, tmp_path):
    url, vdir = two_versions
    obj = data_object(vdir)
    obj.write_bytes(obj.read_bytes()[:-7])
    got, st, evs = restore_with_events(url, tmp_path)
    assert got.step == 1
    assert [e["error_type"] for e in evs if e["event"] == "restore_fallback"] == ["SnapshotCorrupt"]


def test_missing_object_is_incomplete(two_versions, tmp_path):
    url, vdir = two_versions
    data_object(vdir).unlink()
    with pytest.raises(SnapshotIncomplete):
        SnapshotReader(url).read_region(SnapshotReader(url).manifest(2), "model/w")
    assert restore_with_events(url, tmp_path)[0].step == 1


@pytest.mark.parametrize("damage", ["truncate", "garble", "not_json_object"])
def test_bad_manifest_is_corrupt_and_falls_back(two_versions, tmp_path, damage):
    url, vdir = two_versions
    mf = vdir / "manifest.json"
    text = mf.read_bytes()
    mf.write_bytes({"truncate": text[: len(text) // 2], "garble": text.replace(b'"shape"', b'"shap"'),
                    "not_json_object": b"\x00\xff garbage"}[damage])
    with pytest.raises(SnapshotCorrupt) as e:
        SnapshotReader(url).manifest(2)
    assert "manifest.json" in str(e.value)
    assert restore_with_events(url, tmp_path)[0].step == 1


def test_newer_format_version_is_refused(two_versions, tmp_path):
    url, vdir = two_versions
    mf = vdir / "manifest.json"
    doc = json.loads(mf.read_text())
    doc["format_version"] = 99
    mf.write_text(json.dumps(doc))
    with pytest.raises(FormatVersionError, match="upgrade resilient"):
        SnapshotReader(url).manifest(2)
    got, _, evs = restore_with_events(url, tmp_path)
    assert got.step == 1 and evs[0]["error_type"] == "FormatVersionError"


def test_another_models_checkpoint_is_a_mismatch(two_versions, tmp_path):
    url, _ = two_versions
    with pytest.raises(SnapshotMismatch, match="another model"):
        Snapshotter(url, config_digest="gpt-b").restore(blank())
    with pytest.raises(SnapshotMismatch, match="model/w"):
        Snapshotter(url, config_digest="gpt-a").restore({"model": {"w": torch.zeros(41, 10), "b": torch.zeros(10)}})
    with pytest.raises(SnapshotMismatch, match="model/extra"):
        Snapshotter(url, config_digest="gpt-a").restore({"model": {**blank()["model"], "extra": torch.zeros(1)}})
    untouched = blank()
    with pytest.raises(SnapshotMismatch):
        Snapshotter(url, config_digest="gpt-b").restore(untouched)
    assert not untouched["model"]["w"].any()  # nothing was loaded


def test_only_version_corrupt_raises_and_leaves_model_untouched(tmp_path):
    url = f"file://{tmp_path}/ck"
    with Snapshotter(url) as snap:
        snap.save(5, state_at(5))
    obj = data_object(tmp_path / "ck" / "step-000000000005")
    raw = bytearray(obj.read_bytes())
    raw[-1] ^= 1
    obj.write_bytes(bytes(raw))
    st = blank()
    with pytest.raises(SnapshotCorrupt):
        Snapshotter(url).restore(st)
    assert not st["model"]["w"].any() and not st["model"]["b"].any()
    with pytest.raises(NoSnapshotFound):
        SnapshotReader(f"file://{tmp_path}/empty").manifest()


def test_mangled_manifests_only_ever_raise_typed_errors(two_versions):
    """Fuzz: any truncation or byte change of a manifest parses or raises a SnapshotError."""
    from hypothesis import given, settings, strategies as st

    from resilient.snapshot import SnapshotError
    from resilient.snapshot.format import manifest_from_json
    _, vdir = two_versions
    text = (vdir / "manifest.json").read_bytes()

    @settings(max_examples=300, deadline=None)
    @given(st.integers(0, len(text)), st.lists(st.tuples(st.integers(0, len(text) - 1), st.integers(0, 255)),
                                               max_size=3))
    def check(cut, edits):
        data = bytearray(text[:cut] if cut < len(text) and not edits else text)
        for i, b in edits:
            data[i] = b
        try:
            manifest_from_json(bytes(data), "m.json")
        except SnapshotError as e:
            assert "m.json" in str(e)

    check()


def test_manifest_encoding_round_trips_any_manifest():
    """The fragment-assembling encoder (cached per chunk and tensor) decodes to the manifest it
    was given, for any names, shapes, chunks, extras; and to the same JSON a plain dump gives."""
    from hypothesis import given, settings, strategies as st

    from resilient.snapshot.api import ChunkRecord, Manifest, TensorRecord
    from resilient.snapshot.format import FORMAT_NAME, FORMAT_VERSION, manifest_from_json, manifest_to_json

    text = st.text(max_size=12)
    dims = st.lists(st.integers(1, 9), min_size=1, max_size=3)

    @st.composite
    def tensor(draw, name):
        shape = tuple(draw(dims))
        dtype, itemsize = draw(st.sampled_from([("float32", 4), ("bfloat16", 2), ("int64", 8)]))
        # up to 3 chunks, disjoint slices of dim 0 (a manifest's chunks never overlap)
        cuts = sorted(draw(st.lists(st.integers(0, shape[0]), max_size=3, unique=True)) + [shape[0]])
        chunks = []
        for lo, hi in zip([0] + cuts, cuts):
            if hi <= lo or draw(st.booleans()):
                continue
            sizes = (hi - lo,) + shape[1:]
            raw = itemsize
            for d in sizes:
                raw *= d
            comp = draw(st.sampled_from(["none", "zstd"]))
            chunks.append(ChunkRecord(draw(st.sampled_from(["a-000001/r00000-p0000.bin", 'we"ird\\/obj.bin'])),
                                      draw(st.integers(0, 1 << 40)), raw if comp == "none" else draw(st.integers(0, 1 << 20)),
                                      raw, (lo,) + (0,) * (len(shape) - 1), sizes,
                                      f"crc32c:{draw(st.integers(0, 2**32 - 1)):08x}", comp))
        return TensorRecord(name, shape, dtype, chunks)

    @st.composite
    def manifest(draw):
        names = draw(st.lists(text, max_size=5, unique=True))
        return Manifest(step=draw(st.integers(0, 10**9)), world=draw(st.integers(1, 64)),
                        layout={"dp": draw(st.integers(1, 8))}, config_digest=draw(text), attempt=draw(text),
                        tensors={n: draw(tensor(n)) for n in names}, values={k: draw(st.integers()) for k in names[:2]},
                        rank_extras={r: {"rng": draw(text)} for r in range(draw(st.integers(0, 2)))},
                        extra=draw(st.none() | st.dictionaries(text, st.integers(), max_size=2)),
                        created=draw(st.floats(0, 2e9)), rank=draw(st.none() | st.integers(0, 63)))

    @settings(max_examples=200, deadline=None)
    @given(manifest())
    def check(m):
        doc = manifest_to_json(m)
        assert manifest_from_json(doc, "m.json") == m
        plain = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": m.step, "rank": m.rank,
                 "world": m.world, "layout": m.layout, "config_digest": m.config_digest, "attempt": m.attempt,
                 "created": m.created, "values": m.values,
                 "ranks": {str(r): {"extra": e} for r, e in sorted(m.rank_extras.items())}, "extra": m.extra,
                 "tensors": {n: {"shape": list(t.shape), "dtype": t.dtype, "chunks": [c.to_json() for c in t.chunks]}
                             for n, t in m.tensors.items()}}
        assert json.loads(doc) == plain

    check()


def _edit_manifest(vdir: Path, edit) -> None:
    mf = vdir / "manifest.json"
    doc = json.loads(mf.read_text())
    edit(doc)
    mf.write_text(json.dumps(doc))


def test_an_overlap_that_hides_a_gap_is_corrupt(two_versions, tmp_path):
    """One digit of an offset changed: the element count still adds up, but rows of
    the tensor are stored twice and others never; they must not reach the model."""
    url, vdir = two_versions

    def shift(doc):
        chunks = doc["tensors"]["model/w"]["chunks"]
        assert len(chunks) >= 2 and chunks[1]["offsets"][0] > 0
        chunks[1]["offsets"][0] -= 1

    _edit_manifest(vdir, shift)
    with pytest.raises(SnapshotCorrupt, match="chunks of 'model/w' overlap"):
        SnapshotReader(url).manifest(2)
    got, st, evs = restore_with_events(url, tmp_path)
    assert got.step == 1 and torch.equal(st["model"]["w"], state_at(1)["model"]["w"])
    assert [e["error_type"] for e in evs if e["event"] == "restore_fallback"] == ["SnapshotCorrupt"]


@pytest.mark.parametrize("field,value", [("length", 2**45), ("raw_length", 2**45), ("raw_length", -8)])
def test_byte_counts_that_disagree_with_the_box_are_corrupt(two_versions, tmp_path, field, value):
    url, vdir = two_versions
    _edit_manifest(vdir, lambda doc: doc["tensors"]["model/w"]["chunks"][0].__setitem__(field, value))
    with pytest.raises(SnapshotCorrupt):
        SnapshotReader(url).manifest(2)
    assert restore_with_events(url, tmp_path)[0].step == 1


@pytest.mark.parametrize("created", ["10" * 200, "1e400"])
def test_an_absurd_number_is_corrupt_not_an_overflow(two_versions, tmp_path, created):
    url, vdir = two_versions
    mf = vdir / "manifest.json"
    text, n = re.subn(r'"created":\s*[-0-9.eE+]+', f'"created": {created}', mf.read_text())
    assert n == 1
    mf.write_text(text)
    with pytest.raises(SnapshotCorrupt, match="created"):
        SnapshotReader(url).manifest(2)
    assert restore_with_events(url, tmp_path)[0].step == 1


@pytest.mark.parametrize("name", ["step-²", "step-1", "step-00000000000x"])
def test_a_stray_version_directory_is_ignored(two_versions, tmp_path, name):
    url, vdir = two_versions
    (vdir.parent / name).mkdir()
    assert sorted(SnapshotReader(url).complete_steps()) == [1, 2]
    assert restore_with_events(url, tmp_path)[0].step == 2
