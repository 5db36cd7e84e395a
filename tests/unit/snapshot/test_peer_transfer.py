"""A replica push: the part's CRC comes from its rank manifest (combined, not re-read), so
a copy damaged in the sender's store is refused by the peer; the peer lands bytes in place
and a full store refuses a replica with a clear error instead of dying."""

from __future__ import annotations

import json
import mmap
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from resilient.snapshot import SnapshotCorrupt, Snapshotter
from resilient.snapshot.format import crc, crc_combine, object_crcs
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerClient, PeerError, PeerServer
from resilient_chaos.disk import SmallVolume, mount_unavailable

SECRET = bytes(range(32))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096), st.binary(max_size=4096))
def test_combined_crc_is_the_crc_of_the_concatenation(a, b):
    assert crc_combine(crc(a), crc(b), len(b)) == crc(a + b)


@pytest.mark.parametrize("n", [(1 << 29) + 3, 3 << 29])
def test_combined_crc_past_2_to_the_29_bytes(n):
    """Lengths whose bit count passes 32 (zlib's table wraps there; CRC-32C's must not).
    The zeros are an untouched anonymous mapping: no memory is used."""
    a = b"resilient"
    with mmap.mmap(-1, n) as zeros:
        assert crc_combine(crc(a), crc(zeros), n) == crc(zeros, crc(a))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("bad", [
    {"offset": 0, "length": -1, "checksum": "crc32c:00000000"},       # once looped forever
    {"offset": 0, "length": 4, "checksum": "crc32c:xyz"},
    {"offset": 0, "length": 4, "checksum": "crc32c:1234567890"},
    {"offset": "0", "length": 4, "checksum": "crc32c:00000000"},
    {"offset": 0, "length": True, "checksum": "crc32c:00000000"},
    {"offset": 0, "length": 4, "checksum": 7},
    {"offset": 2, "length": 4, "checksum": "crc32c:00000000"},        # does not start at 0
])
def test_object_crcs_leaves_out_what_it_cannot_vouch_for(bad):
    good = {"object": "a/r00000-p0000.bin", "offset": 0, "length": 3, "checksum": f"crc32c:{crc(b'abc'):08x}"}
    doc = json.dumps({"tensors": {"t": {"chunks": [good, {"object": "a/r00000-p0001.bin", **bad}]}}})
    assert object_crcs(doc) == {"a/r00000-p0000.bin": (crc(b"abc"), 3)}
    assert object_crcs(b"{not json") == {} and object_crcs(b'{"tensors": 3}') == {}


def written_version(tmp_path) -> tuple[os.PathLike, dict[str, int]]:
    """A real rank 0 version (several chunks per part), and its parts' combined CRCs."""
    root = tmp_path / "src"
    state = {"w": torch.randn(300, 7), "b": torch.arange(50.0), "i": torch.arange(33, dtype=torch.int16)}
    with Snapshotter(f"file://{root}", chunk_bytes=1000, part_bytes=3000) as snap:
        snap.save(3, state)
        assert snap.wait()
    mpath = next(root.glob("step-*/*/r00000.json"))
    return root, object_crcs(mpath.read_bytes())


def test_object_crcs_match_the_part_files(tmp_path):
    root, crcs = written_version(tmp_path)
    vdir = next(root.glob("step-*"))
    parts = sorted(p.relative_to(vdir).as_posix() for p in vdir.glob("*/r00000-p*.bin"))
    assert len(parts) > 1 and sorted(crcs) == parts
    for obj in parts:
        data = (vdir / obj).read_bytes()
        assert crcs[obj] == (crc(data), len(data))


@pytest.fixture
def peer(tmp_path):
    store = NodeStore(tmp_path / "peer", "job", "n1")
    store.create()
    srv = PeerServer(store, SECRET, host="127.0.0.1")
    yield store, srv
    srv.close()
    store.remove()


def test_a_part_damaged_in_the_senders_store_is_refused_by_the_peer(tmp_path, peer):
    store, srv = peer
    root, crcs = written_version(tmp_path)
    vdir = next(root.glob("step-*"))
    obj = sorted(crcs)[0]
    rel = f"{vdir.name}/{obj}"
    with PeerClient(srv.address, SECRET) as c:
        c.put_file(rel, vdir / obj, crcs[obj])  # intact: accepted, byte for byte
        assert store.read(rel) == (vdir / obj).read_bytes()
        damaged = bytearray((vdir / obj).read_bytes())
        damaged[len(damaged) // 2] ^= 0x10
        (vdir / obj).write_bytes(bytes(damaged))
        other = rel.replace("-p0000", "-p0009")
        with pytest.raises(PeerError, match="refused"):
            c.put_file(other, vdir / obj, crcs[obj])
        (vdir / obj).write_bytes(bytes(damaged) + b"tail")  # another size: refused before sending
        with pytest.raises(SnapshotCorrupt, match="add up to"):
            c.put_file(other, vdir / obj, crcs[obj])
        c.put(other.replace("-p0009", "-p0008"), b"the connection is still usable")
    assert not store.file(other).exists()
    assert not [p for p in store.file(other).parent.iterdir() if ".tmp-" in p.name]


REASON = mount_unavailable()


@pytest.mark.skipif(REASON is not None, reason=f"cannot mount a tmpfs: {REASON}")
def test_a_full_store_refuses_a_replica_and_keeps_serving():
    rel = "step-000000000005/abc-000001/r00000-p0000.bin"
    with SmallVolume(1 << 20) as vol:
        store = NodeStore(vol.path, "job", "n1")
        store.create()
        srv = PeerServer(store, SECRET, host="127.0.0.1")
        try:
            with PeerClient(srv.address, SECRET) as c:
                for size in (2 << 20, 8 << 20):  # 8 MiB: more than the socket buffers hold
                    with pytest.raises(PeerError, match="No space left"):
                        c.put(rel, os.urandom(size))
            assert not store.file(rel).exists()
            assert not [p for p in store.file(rel).parent.iterdir() if ".tmp-" in p.name]
            with PeerClient(srv.address, SECRET) as c:  # the server lives on, with room again
                c.put(rel, b"small" * 100)
                assert c.get(rel) == b"small" * 100
        finally:
            srv.close()
            store.remove()


@pytest.mark.parametrize("signed", [False, True])
def test_the_agents_push_sends_intact_parts_without_rereading_and_refuses_a_damaged_one(tmp_path, peer,
                                                                                        monkeypatch, signed):
    """``Replicator._push`` (the agent's replication of a rank): parts go out with the CRC
    from the rank manifest, the manifest last; a part damaged in this node's store stops
    the rank's push before its manifest, so the peer never holds the rank as whole. Signed
    (chunk MACs in the manifest), the parts go with their chunks' MACs, untagged, and the
    peer refuses the damaged one by its chunk's MAC; unsigned, every piece is tagged and the
    CRC refuses it."""
    from resilient.snapshot import peer as peer_mod
    from resilient.snapshot.memcommit import Replicator, ReplicatorOptions

    dest, srv = peer
    src = NodeStore(tmp_path / "src", "job", "n0")
    src.create()
    rep = Replicator(src, None, "job", "n0", SECRET, lambda: {}, ReplicatorOptions(), None)
    try:
        state = {"w": torch.randn(3000, 7), "b": torch.arange(50.0)}
        with Snapshotter(src.url, commit=False, compress="none", chunk_bytes=4000, part_bytes=30000,
                         **({"secret": SECRET} if signed else {})) as snap:
            for step in (1, 2):
                snap.save(step, state)
                assert snap.wait()
        v1, v2 = src.versions()

        expected = []
        put_file = peer_mod.PeerClient.put_file

        vouched = []

        def recording(self, rel, path, expect=None, macs=None):
            expected.append(expect)
            vouched.append(macs)
            return put_file(self, rel, path, expect, macs)
        monkeypatch.setattr(peer_mod.PeerClient, "put_file", recording)
        rep._push("n1", srv.address, v1, [0])
        files = src.rank_files(v1.step, v1.attempt, 0)
        assert len(files) > 2 and all(dest.read(rel) == src.read(rel) for rel in files)
        assert len(expected) == len(files) - 1 and None not in expected  # every part: CRC from the manifest
        # signed: every part with its chunks' MACs (several chunks a part, tiling it)
        assert all((m is not None and len(m) > 1) if signed else m is None for m in vouched), vouched

        *parts, manifest = src.rank_files(v2.step, v2.attempt, 0)
        damaged = bytearray(src.read(parts[1]))
        damaged[7] ^= 0x01
        src.file(parts[1]).write_bytes(bytes(damaged))
        with pytest.raises(PeerError, match="refused.*" + ("chunk's MAC" if signed else "crc32c")):
            rep._push("n1", srv.address, v2, [0])
        assert dest.read(parts[0]) == src.read(parts[0])  # sent before the damaged one
        assert not dest.file(manifest).exists() and not dest.file(parts[1]).exists()
        assert [v.step for v in dest.versions()] == [1]   # step 2 is not a version on the peer
    finally:
        rep.close()
        src.remove()


def test_a_push_after_the_store_closed_leaves_nothing_behind(tmp_path):
    """A peer's replicator keeps its connection open; a push that arrives after the
    agent closed its server and removed its store must not build a new tree in
    shared memory (no owner file: no reclaim would ever remove it)."""
    store = NodeStore(tmp_path, "job", "a")
    store.create()
    srv = PeerServer(store, SECRET, host="127.0.0.1")
    client = PeerClient(srv.address, SECRET)
    try:
        srv.close()
        store.remove()
        with pytest.raises((PeerError, OSError)):
            client.put("step-000000000007/abc-000001/r00000-p0000.bin", b"x" * 4096)
    finally:
        client.close()
    assert not any(tmp_path.iterdir())


def test_store_directories_are_private_and_names_are_checked_whole(tmp_path):
    from resilient.snapshot.nodestore import check_rel

    store = NodeStore(tmp_path, "job", "a")
    store.create()
    w = store.writer("step-000000000007/abc-000001/r00000.json")
    w.write(b"{}")
    w.commit(2, crc(b"{}"))
    for d in (store.path / "step-000000000007", store.path / "step-000000000007" / "abc-000001"):
        assert d.stat().st_mode & 0o777 == 0o700
    with pytest.raises(ValueError):
        check_rel("step-000000000007/abc-000001/r00000.json\n")
    store.remove()
    with pytest.raises(FileNotFoundError):
        store.writer("step-000000000007/abc-000001/r00000.json")
    assert not any(tmp_path.iterdir())
