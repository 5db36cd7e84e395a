"""Authenticated versions (issue 39, item 1): a forgery with its CRCs recomputed (the attack a
CRC cannot see) is refused on every read path, with an ``auth_failure``, and restore goes on
to the previous version; unsigned versions are refused under a secret until ``ckpt sign``
adopts them; the tools check integrity without the secret, authenticity with it, and sign
what they write."""

from __future__ import annotations

import json
import re

import pytest
import torch

from resilient.events import EventLog, read_events
from resilient.secret import JobSecret
from resilient.snapshot import Snapshotter, SnapshotReader
from resilient.snapshot.auth import SnapshotUnauthentic, SnapshotUnsigned
from resilient.snapshot.format import checksum

from forgeutil import forge_crc

SECRET = JobSecret(b"a" * 40)
OTHER = JobSecret(b"b" * 40)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}}


def _save(url: str, steps: dict[int, dict], secret=SECRET, compress: str = "none") -> None:
    with Snapshotter(url, secret=secret, compress=compress, keep_last=10) as snap:
        for step, state in steps.items():
            snap.save(step, state, force=True)
            assert snap.wait()  # each its own version (a faster save would coalesce it away)


def _forge_chunk(root, step: int, value: float = 1e4, keep_crc: bool = True) -> None:
    """What the attacker did to the node store: overwrite a chunk's bytes with 1e4 everywhere and
    make its CRC-32C check out: either by forging 4 bytes so the CRC stays (``keep_crc``: the
    manifest untouched), or by recomputing the CRC in the manifest (whose MAC then fails)."""
    (vdir,) = root.glob(f"step-{step:012d}")
    manifest = vdir / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    c = doc["tensors"]["model/w"]["chunks"][0]
    part = vdir / c["object"]
    data = bytearray(part.read_bytes())
    poison = torch.full((c["raw_length"] // 4,), value).numpy().tobytes()
    if keep_crc:
        poison = forge_crc(poison, int(c["checksum"].split(":")[1], 16))
    data[c["offset"]:c["offset"] + c["length"]] = poison
    part.write_bytes(bytes(data))
    if not keep_crc:
        manifest.write_text(manifest.read_text().replace(c["checksum"], checksum(poison)))


def test_a_forged_chunk_with_its_crc_recomputed_is_refused_and_the_older_version_restored(tmp_path):
    url = (tmp_path / "ckpt").as_uri()
    _save(url, {1: _state(1), 2: _state(2)})
    _forge_chunk(tmp_path / "ckpt", 2)
    with pytest.raises(SnapshotUnauthentic, match="forged, not damaged"):
        r = SnapshotReader(url, secret=SECRET)
        m = r.manifest(2)
        r.read_region(m, "model/w")
    events = EventLog(tmp_path / "events.jsonl")
    target = _state(9)
    got = Snapshotter(url, secret=SECRET, events=events).restore(target)
    assert got.step == 1 and torch.equal(target["model"]["w"], _state(1)["model"]["w"])
    kinds = [e["event"] for e in read_events(events.path)]
    assert "auth_failure" in kinds and "restore_fallback" in kinds
    # without the secret only the CRCs are checked: the forgery passes them (why MACs exist)
    target = _state(9)
    assert Snapshotter(url, secret=None).restore(target).step == 2 and target["model"]["w"].max() == 1e4


def test_a_chunk_forged_with_its_crc_recomputed_in_the_manifest_is_refused_at_the_manifest(tmp_path):
    url = (tmp_path / "ckpt").as_uri()
    _save(url, {1: _state(1), 2: _state(2)})
    _forge_chunk(tmp_path / "ckpt", 2, keep_crc=False)  # the attack as it was done on the node store
    with pytest.raises(SnapshotUnauthentic, match="MAC does not verify"):
        SnapshotReader(url, secret=SECRET).manifest(2)
    target = _state(9)
    assert Snapshotter(url, secret=SECRET).restore(target).step == 1
    assert torch.equal(target["model"]["w"], _state(1)["model"]["w"])


def test_a_forged_manifest_or_one_signed_with_another_secret_is_never_parsed_as_genuine(tmp_path):
    url = (tmp_path / "ckpt").as_uri()
    _save(url, {1: _state(1), 2: _state(2)})
    manifest = next((tmp_path / "ckpt").glob("step-000000000002")) / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"config_digest":""', '"config_digest":"x"'))  # any change at all
    with pytest.raises(SnapshotUnauthentic, match="MAC does not verify"):
        SnapshotReader(url, secret=SECRET).manifest(2)
    manifest.write_text(text)
    with pytest.raises(SnapshotUnauthentic):
        SnapshotReader(url, secret=OTHER).manifest(2)
    manifest.write_text(re.sub(r',"mac":"hmac-sha256:[0-9a-f]+"\}$', "}", text))  # MAC stripped
    with pytest.raises(SnapshotUnsigned, match="ckpt sign"):
        SnapshotReader(url, secret=SECRET).manifest(2)


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_unsigned_versions_are_refused_until_ckpt_sign_adopts_them(tmp_path, compress, capsys):
    from resilient_tools.cli import main as ckpt

    url = (tmp_path / "old").as_uri()
    _save(url, {3: _state(3)}, secret=None, compress=compress)  # written before authenticated versions
    secret_file = tmp_path / "job.secret"
    secret_file.write_text(SECRET.material.decode())
    secret_file.chmod(0o600)
    with pytest.raises(SnapshotUnsigned):
        Snapshotter(url, secret=SECRET).restore(_state(9))
    assert ckpt(["-q", "verify", str(tmp_path / "old")]) == 0
    assert "integrity only" in capsys.readouterr().out
    assert ckpt(["-q", "--secret-file", str(secret_file), "verify", str(tmp_path / "old")]) == 1
    assert "carries no MAC" in capsys.readouterr().out
    assert ckpt(["-q", "--secret-file", str(secret_file), "sign", str(tmp_path / "old")]) == 0
    assert ckpt(["-q", "--secret-file", str(secret_file), "verify", str(tmp_path / "old")]) == 0
    assert "authenticity" in capsys.readouterr().out
    target = _state(9)
    assert Snapshotter(url, secret=SECRET).restore(target).step == 3
    assert torch.equal(target["model"]["w"], _state(3)["model"]["w"])


def test_ckpt_verify_finds_the_forgery_only_with_the_secret_and_tool_output_is_signed(tmp_path, capsys):
    from resilient_tools.cli import main as ckpt

    url = (tmp_path / "ckpt").as_uri()
    _save(url, {2: _state(2)})
    _forge_chunk(tmp_path / "ckpt", 2)
    secret_file = tmp_path / "job.secret"
    secret_file.write_text(SECRET.material.decode())
    secret_file.chmod(0o600)
    assert ckpt(["-q", "verify", str(tmp_path / "ckpt")]) == 0  # integrity holds: CRCs recomputed
    assert ckpt(["-q", "--secret-file", str(secret_file), "verify", str(tmp_path / "ckpt")]) == 1
    assert "forged" in capsys.readouterr().out
    # import and reshard sign what they write, for the secret given
    _save((tmp_path / "good").as_uri(), {4: _state(4)})
    out = tmp_path / "w.safetensors"
    assert ckpt(["-q", "--secret-file", str(secret_file), "convert", str(tmp_path / "good"), str(out),
                 "--format", "safetensors"]) == 0
    assert ckpt(["-q", "--secret-file", str(secret_file), "import", str(out), str(tmp_path / "imp"),
                 "--from", "safetensors"]) == 0
    assert ckpt(["-q", "--secret-file", str(secret_file), "reshard", str(tmp_path / "good"), "--to", "dp=2",
                 str(tmp_path / "resh")]) == 0
    for made in ("imp", "resh"):
        r = SnapshotReader((tmp_path / made).as_uri(), secret=SECRET)
        m = r.manifest(r.complete_steps()[-1])
        assert all(c.mac for t in m.tensors.values() for c in t.chunks)
        assert not r.verify(m)
        with pytest.raises(SnapshotUnauthentic):
            SnapshotReader((tmp_path / made).as_uri(), secret=OTHER).manifest(m.step)


def test_the_committer_refuses_a_rank_manifest_it_cannot_authenticate(tmp_path):
    """A rank manifest put into the durable tier beside the ranks' own is not merged and signed."""
    url = (tmp_path / "ckpt").as_uri()
    events = EventLog(tmp_path / "events.jsonl")
    with Snapshotter(url, secret=SECRET, events=events, compress="none") as snap:
        snap._committer.auth = OTHER_AUTH  # as if the rank wrote with a secret the committer does not hold
        snap.save(5, _state(5), force=True)
    assert not list((tmp_path / "ckpt").glob("step-*/manifest.json"))
    assert any(e["event"] == "auth_failure" for e in read_events(events.path))


from resilient.snapshot.auth import VersionAuth  # noqa: E402

OTHER_AUTH = VersionAuth(OTHER)


def test_chunk_sizes_stay_within_what_a_reader_takes_and_one_gmac_call_takes(monkeypatch):
    """``snapshot.chunk_mib`` is bounded by what a reader inflates (1 GiB, refused above before
    allocation) and so by one AES-GMAC call's 2 GiB; a chunk above one call (a single row that
    large) is tagged in slices, to the same tag a single call gives."""
    import os

    from resilient.errors import ConfigError
    from resilient.snapshot import auth
    from resilient.snapshot.api import ChunkRecord
    from resilient.snapshot.config import MAX_CHUNK_MIB, SnapshotConfig
    from resilient.snapshot.format import MAX_INFLATE

    assert MAX_CHUNK_MIB << 20 == MAX_INFLATE < auth.ONE_CALL
    for bad in (0, -1, MAX_CHUNK_MIB + 1, 1 << 20, True, 1.5):
        with pytest.raises(ConfigError, match="snapshot.chunk_mib"):
            SnapshotConfig(chunk_mib=bad)
    with pytest.raises(ConfigError, match="snapshot.part_mib"):
        SnapshotConfig(part_mib=0)
    SnapshotConfig(chunk_mib=MAX_CHUNK_MIB)

    va, raw, nonce = auth.VersionAuth(SECRET), bytearray(os.urandom(5000)), os.urandom(auth.NONCE)
    whole = va.chunk_mac(3, "a-000001", raw, nonce)
    monkeypatch.setattr(auth, "ONE_CALL", 1000)   # as if the chunk were above 2 GiB
    assert va.chunk_mac(3, "a-000001", raw, nonce) == whole
    chunk = ChunkRecord("a-000001/r00000-p0000.bin", 0, len(raw), len(raw), (0,), (len(raw),), "", "none", whole)
    assert va.chunk_ok(3, chunk, raw)
    raw[4321] ^= 1
    assert not va.chunk_ok(3, chunk, raw)
