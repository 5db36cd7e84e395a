"""The memory tiers' CPU savers: the replication budget (a stride of versions that all
agents agree on), spare files rewritten in place, and pushes that send a file as is.
Each keeps what restore relies on: a committed version's bytes are never touched."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest

from resilient.snapshot.format import crc
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions
from resilient.snapshot.nodestore import SPARES, LocalVersion, NodeStore, Spares
from resilient.snapshot.peer import PeerClient, PeerServer
from resilient.snapshot.storage import node_store_path, write_object

SECRET = bytes(range(32))


def _part(step: int, rank: int = 0) -> str:
    return f"step-{step:012d}/abc123-000001/r{rank:05d}-p0000.bin"


def _manifest(step: int, rank: int = 0) -> str:
    return f"step-{step:012d}/abc123-000001/r{rank:05d}.json"


def _put(store: NodeStore, rel: str, data: bytes) -> None:
    w = store.writer(rel)
    w.write(data)
    w.commit(len(data), crc(data))


@pytest.fixture
def store(tmp_path):
    s = NodeStore(tmp_path, "job", "n0")
    s.create()
    yield s
    s.remove()


def test_retired_files_are_rewritten_in_place(store):
    for step in (1, 2):
        _put(store, _part(step), bytes([step]) * 5000)
        _put(store, _manifest(step), b"{}")
    assert store.retain(keep={2}, below=2) == [1]
    spare = store.path / SPARES
    assert len(os.listdir(spare)) == 1  # the part, not the manifest
    inode = os.stat(spare / os.listdir(spare)[0]).st_ino
    _put(store, _part(3), b"short")     # shorter than the spare: truncated to what was written
    assert store.read(_part(3)) == b"short"
    assert os.stat(store.file(_part(3))).st_ino == inode
    assert os.listdir(spare) == []
    assert store.read(_part(2)) == bytes([2]) * 5000  # the kept version is untouched
    _put(store, _part(4), b"fresh")     # no spare left: a new file
    assert store.read(_part(4)) == b"fresh"


def test_spares_are_bounded_and_claimed_once(store, tmp_path):
    for step in range(1, 4):
        for r in range(Spares.limit):
            _put(store, _part(step, r), b"x" * 100)
    store.retain(keep=set(), below=3)
    spares = store.spares
    assert len(os.listdir(spares.path)) == Spares.limit
    got = [spares.claim(store.path / f"claimed-{i}") for i in range(Spares.limit + 1)]
    assert got == [True] * Spares.limit + [False]


def test_a_ranks_writer_uses_the_node_stores_spares(store, tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    assert node_store_path(fs, str(tmp_path)) is None  # not a node store: plain writes
    assert node_store_path(fs, str(store.path)) == store.path
    spares = store.spares
    _put(store, _part(1), b"y" * 4000)
    store.retain(keep=set(), below=1)
    path = str(store.file(_part(2)))
    write_object(fs, path, [b"ab", b"cd"], 4, spares)
    assert store.read(_part(2)) == b"abcd"
    assert os.listdir(spares.path) == []


def test_put_file_sends_the_file_checksummed(store, tmp_path):
    other = NodeStore(tmp_path, "job", "n1")
    other.create()
    srv = PeerServer(other, SECRET, host="127.0.0.1")
    try:
        data = os.urandom(3 << 20) + b"tail"  # several pieces
        _put(store, _part(5), data)
        _put(store, _manifest(5), b"")          # empty files too
        with PeerClient(srv.address, SECRET) as c:
            assert c.put_file(_part(5), store.file(_part(5))) == len(data)
            assert c.put_file(_manifest(5), store.file(_manifest(5))) == 0
        assert other.read(_part(5)) == data and other.read(_manifest(5)) == b""
    finally:
        srv.close()
        other.remove()


class _Events:
    def __init__(self):
        self.got = []

    def emit(self, kind, **fields):
        self.got.append((kind, fields))


def _replicator(store: NodeStore, **opts) -> Replicator:
    return Replicator(store, None, "job", "n0", SECRET, lambda: {}, ReplicatorOptions(**opts), _Events())


def test_budget_strides_in_powers_of_two_up_to_the_cap(store):
    rep = _replicator(store, duty=0.1, max_stride=4)
    try:
        t = time.time()
        for step in range(1, 4):  # versions land 0.2 s apart, one step each
            rep._observe(LocalVersion(step, "a", frozenset({0}), t + 0.2 * step))
        rep._budget(0.01)
        assert rep._stride == 1    # 5% of the gap: every version
        rep._cost = 0.0
        rep._budget(0.03)
        assert rep._stride == 2    # 15%: every other version
        rep._cost = 0.0
        rep._budget(1.0)
        assert rep._stride == 4    # capped
        for unbounded in (_replicator(store, duty=1.0), _replicator(store)):
            # duty 1, and the defaults (max_stride 1: at most one step lost per failure)
            unbounded._gap = 0.2
            unbounded._budget(1.0)
            assert unbounded._stride == 1
            unbounded.close()
    finally:
        rep.close()


def test_budget_takes_multiples_of_the_stride_and_flush_takes_the_newest(store):
    rep = _replicator(store, duty=0.1, max_stride=4)
    try:
        for step in (4, 5, 6):
            _put(store, _part(step), b"z")
            _put(store, _manifest(step), b"{}")
        with rep._cond:
            rep.local_ranks, rep.world, rep.since = frozenset({0}), 1, 0.0
            rep._stride, rep._unit = 4, 1
        newest, due = rep._newest_ready()
        assert (newest.step, due.step) == (6, 4)
        rep._urgent = True
        assert rep._newest_ready()[1].step == 6
    finally:
        with rep._cond:
            rep.local_ranks = frozenset()
        rep.close(timedelta(seconds=5))


def test_retention_keeps_the_newest_handled_version(store):
    """A version whose holds this agent recorded may still be committed by another agent:
    skipping ahead must not delete it."""
    rep = _replicator(store, keep=1)
    try:
        for step in (8, 9, 10, 11):
            _put(store, _part(step), b"v")
            _put(store, _manifest(step), b"{}")
        with rep._cond:
            rep.done = 8
        rep._retain(below=10)
        assert sorted(v.step for v in store.versions()) == [8, 10, 11]
    finally:
        rep.close()


def test_a_rank_rings_the_agents_doorbell_after_each_version(store):
    import torch

    from resilient.snapshot import Snapshotter
    from resilient.snapshot.nodestore import BELL, Doorbell

    bell = Doorbell(store.path)
    try:
        assert bell.sock is not None
        assert not bell.wait(timedelta(milliseconds=50))  # nothing landed yet
        Doorbell.ring(store.path / "missing.bell")  # a ring nobody hears is not an error
        snap = Snapshotter(store.url, every=1, compress="none", commit=False, secret=SECRET)
        try:
            snap.save(1, {"w": torch.arange(10.0)})
            assert snap.wait()
            assert bell.wait(timedelta(seconds=5))  # the rank manifest landed
            assert [v.step for v in store.versions()] == [1]
        finally:
            snap.close()
    finally:
        bell.close()
    assert not (store.path / BELL).exists()


def test_the_doorbell_rings_at_a_path_longer_than_a_socket_name(tmp_path):
    """A store under a deep root (pytest-xdist's temp dirs, a container's /dev/shm) has a
    doorbell path past the 107 bytes a socket name holds: it still binds and rings."""
    from resilient.snapshot.nodestore import Doorbell

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    bell = Doorbell(deep)
    try:
        assert len(str(bell.path)) > 107 and bell.sock is not None
        Doorbell.ring(bell.path)
        assert bell.wait(timedelta(seconds=5))
    finally:
        bell.close()
    assert not bell.path.exists()


def test_a_stray_file_in_a_version_directory_does_not_stop_the_listing(store):
    """The replicator lists versions every turn, outside its error handling: a file where
    an attempt directory belongs once raised NotADirectoryError and ended replication."""
    _put(store, _part(3), b"v")
    _put(store, _manifest(3), b"{}")
    (store.path / "step-000000000003" / "manifest.json").write_text("{}")
    assert [(v.step, v.ranks) for v in store.versions()] == [(3, frozenset({0}))]


def test_the_replicator_takes_versions_an_auto_interval_put_at_any_step(tmp_path):
    """Auto versions need not lie on multiples of one gap (5 steps apart, then 2, then 6): at
    stride 1 the agent's replicator takes the newest whatever its step (it once kept only the
    multiples of the smallest gap seen, and would have skipped steps 9, 11 and 17 for ever)."""
    store = NodeStore(tmp_path, "job", "n0")
    store.create()
    rep = _replicator(store)
    try:
        with rep._cond:
            rep.local_ranks, rep.world, rep.since = frozenset({0}), 1, 0.0
            rep._unit = 5          # the smallest gap seen so far
        for step in (4, 9, 11, 17):
            _put(store, _part(step), b"z")
            _put(store, _manifest(step), b"{}")
            newest, due = rep._newest_ready()
            assert newest.step == step and due is not None and due.step == step
            with rep._cond:
                rep.done = step
    finally:
        with rep._cond:
            rep.local_ranks = frozenset()
        rep.close(timedelta(seconds=5))
        store.remove()
