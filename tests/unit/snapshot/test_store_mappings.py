"""Node-store files written through kept mappings: a spare claimed back by the writer of
its rank is rewritten through the mapping that writer already has, and what a write
lands is exactly its bytes, whatever the spare held before."""

from __future__ import annotations

import os

import fsspec
import pytest

from resilient.snapshot.mapping import MAPPINGS, Mappings, write_mapped
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.storage import write_object


def _part(step: int, rank: int = 0) -> str:
    return f"step-{step:012d}/abc123-000001/r{rank:05d}-p0000.bin"


def _key(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


@pytest.fixture
def store(tmp_path):
    MAPPINGS.clear()
    s = NodeStore(tmp_path, "job", "n0")
    s.create()
    yield s
    s.remove()


def _write(store: NodeStore, rel: str, pieces: list[bytes]) -> None:
    write_object(fsspec.filesystem("file"), str(store.file(rel)), pieces, sum(map(len, pieces)), store.spares)


def test_write_mapped_lands_exactly_the_planned_bytes(tmp_path):
    path = tmp_path / "f"
    with open(path, "w+b") as f:
        write_mapped(f, [b"ab", memoryview(b"cde"), bytearray(b"f")], 6)
        f.truncate()
    assert path.read_bytes() == b"abcdef"
    for pieces in ([b"abc", b"def"], [b"ab"]):  # more or fewer bytes than planned
        with open(path, "r+b") as f, pytest.raises(OSError, match="planned"):
            write_mapped(f, pieces, 4)
    MAPPINGS.clear()


def test_a_spare_written_again_by_its_rank_reuses_the_mapping(store):
    _write(store, _part(1, 0), [b"a" * 5000])
    _write(store, _part(1, 1), [b"b" * 5000])
    mine = _key(store.file(_part(1, 1)))
    mapping = MAPPINGS._maps[mine][1]
    store.retain(keep=set(), below=1)  # both files become spares
    _write(store, _part(2, 1), [b"c" * 3000, b"d" * 2000])
    assert _key(store.file(_part(2, 1))) == mine  # rank 1 got rank 1's file back...
    assert MAPPINGS._maps[mine][1] is mapping     # ...and wrote it through the same mapping
    assert store.read(_part(2, 1)) == b"c" * 3000 + b"d" * 2000


def test_rewritten_spares_hold_exactly_the_new_bytes_when_shorter_or_longer(store):
    for step, size in enumerate((5000, 100, 9000, 4096), start=1):
        data = bytes([step]) * size
        _write(store, _part(step), [data])
        assert store.read(_part(step)) == data
        assert os.path.getsize(store.file(_part(step))) == size
        store.retain(keep=set(), below=step)


def test_the_mapping_of_a_deleted_file_is_dropped_before_space_is_reserved(store):
    _write(store, _part(1), [b"x" * (1 << 20)])
    gone = _key(store.file(_part(1)))
    os.unlink(store.file(_part(1)))  # not a spare: its pages must not stay held
    assert gone in MAPPINGS._maps  # held by our mapping until the next write
    _write(store, _part(2), [b"y" * 8192])
    assert gone not in MAPPINGS._maps


def test_a_mapping_in_use_survives_clear(store):
    path = store.path / "f"
    with open(path, "w+b") as f:
        f.truncate(4096)
        with MAPPINGS.view(f, 4096) as view:
            MAPPINGS.clear()  # the store going away while a peer thread still writes
            view[:3] = b"abc"  # no "mmap closed" error, no crash
    assert path.read_bytes()[:3] == b"abc"


def test_at_most_limit_mappings_are_kept(store, monkeypatch):
    monkeypatch.setattr(Mappings, "limit", 2)
    for r in range(3):
        _write(store, _part(1, r), [bytes([r]) * 4096])
    assert list(MAPPINGS._maps) == [_key(store.file(_part(1, r))) for r in (1, 2)]
    assert [store.read(_part(1, r)) for r in range(3)] == [bytes([r]) * 4096 for r in range(3)]


def test_claim_prefers_the_spare_that_had_the_name(store):
    for r in range(3):
        _write(store, _part(1, r), [b"z" * 100])
    inodes = {r: os.stat(store.file(_part(1, r))).st_ino for r in range(3)}
    store.retain(keep=set(), below=1)
    spares = store.spares
    target = store.path / "claimed"
    assert spares.claim(target, like="r00002-p0000.bin")
    assert os.stat(target).st_ino == inodes[2]
    assert spares.claim(store.path / "any", like="r00009-p0000.bin")  # none had it: any spare
