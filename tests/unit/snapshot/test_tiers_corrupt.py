"""A peer that hands back a corrupted replica: detected by the chunk CRC, reported,
and another copy (or tier) used; the bad bytes never reach the state."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

from resilient.events import EventLog, read_events
from resilient.snapshot import Snapshotter, SnapshotReader
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerClient, PeerServer
from resilient.snapshot.restore import restore_candidates
from resilient.snapshot.tiers import MemoryReader, StoreInfo

SECRET = b"s" * 32


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "optim": {"w": {"exp_avg": torch.randn(64, 32, generator=g)}}}


@contextmanager
def _nodes(tmp_path, names):
    """A node store and a peer server per node name; all closed and removed at the end."""
    stores = {n: NodeStore(tmp_path / "shm", "job", n) for n in names}
    for s in stores.values():
        s.create()
    servers = {n: PeerServer(stores[n], SECRET, host="127.0.0.1") for n in names}
    try:
        yield stores, servers
    finally:
        for s in servers.values():
            s.close()
        for s in stores.values():
            s.remove()


def _flip_byte(path, i: int, mask: int) -> None:
    """Flip bits of byte ``i`` of a store file, at rest."""
    data = bytearray(path.read_bytes())
    data[i] ^= mask
    path.write_bytes(bytes(data))


def _reader(tmp_path, attempt: str, holders: list[str], servers: dict) -> tuple[EventLog, MemoryReader]:
    """Node "reader"'s events and its MemoryReader of step 5, held by ``holders``."""
    events = EventLog(tmp_path / "events.jsonl", node="reader")
    info = StoreInfo(base=str(tmp_path / "shm"), run_id="job", node="reader", etcd="", secret_file="")
    plan = {"step": 5, "attempt": attempt, "world": 1, "holders": {"0": holders},
            "peers": {n: servers[n].address for n in holders}}
    return events, MemoryReader(plan, info, SECRET, events)


def _assert_same(target: dict, original: dict) -> None:
    for k in ("w", "b"):
        assert torch.equal(target["model"][k], original["model"][k])
    assert torch.equal(target["optim"]["w"]["exp_avg"], original["optim"]["w"]["exp_avg"])


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_peer_copy_is_skipped_for_another(tmp_path, damage):
    with _nodes(tmp_path, ["writer", "b", "c", "reader"]) as (stores, servers):
        original = _state(1)
        with Snapshotter(stores["writer"].url, commit=False, secret=SECRET, compress="none", chunk_bytes=2048) as snap:
            snap.save(5, original, extra={"rng": None}, global_extra={"step": 5}, force=True)
        (v,) = stores["writer"].versions()
        files = stores["writer"].rank_files(v.step, v.attempt, 0)
        for peer in ("b", "c"):  # replicate like the agent does
            with PeerClient(servers[peer].address, SECRET) as c:
                for rel in files:
                    c.put(rel, stores["writer"].read(rel))
        bad_file = stores["b"].file(files[0])
        if damage == "flip":
            _flip_byte(bad_file, 100, 0x40)  # one flipped bit in b's copy, at rest
        else:
            os.truncate(bad_file, os.path.getsize(bad_file) - 7)  # a short copy is as bad

        events, reader = _reader(tmp_path, v.attempt, ["b", "c"], servers)
        target = _state(2)
        got = restore_candidates([(5, reader, "memory")], target, rank=0, events=events)
        reader.close()
        assert got.step == 5
        _assert_same(target, original)
        evs = list(read_events(tmp_path / "events.jsonl"))
        bad = [e for e in evs if e["event"] == "restore_fallback"]
        assert bad and bad[0]["holder"] == "b" and bad[0]["copy_skipped"]
        assert ("checksum" if damage == "flip" else "bytes") in bad[0]["error"]
        (ok,) = [e for e in evs if e["event"] == "restore"]
        assert ok["tier"] == "peer"


def test_corrupt_local_copy_read_straight_into_the_state_is_replaced_by_a_peers(tmp_path, monkeypatch):
    """``direct``: this node's copy is read into the live tensors themselves; a flipped bit
    there is caught in place, reported, and a peer's good copy written over it."""
    with _nodes(tmp_path, ["reader", "c"]) as (stores, servers):
        original = _state(5)
        with Snapshotter(stores["reader"].url, commit=False, secret=SECRET, compress="none", chunk_bytes=2048) as snap:
            snap.save(5, original, extra={"rng": None}, global_extra={"step": 5}, force=True)
        (v,) = stores["reader"].versions()
        files = stores["reader"].rank_files(v.step, v.attempt, 0)
        with PeerClient(servers["c"].address, SECRET) as c:
            for rel in files:
                c.put(rel, stores["reader"].read(rel))
        _flip_byte(stores["reader"].file(files[0]), 100, 0x08)
        events, reader = _reader(tmp_path, v.attempt, ["reader", "c"], servers)
        whole = NodeStore.read

        def manifests_only(store, rel, *a, **kw):   # this node's chunks are read in place, never as bytes
            assert store.node != "reader" or rel.endswith(".json"), rel
            return whole(store, rel, *a, **kw)
        monkeypatch.setattr(NodeStore, "read", manifests_only)
        target = _state(6)
        live = target["model"]["w"].data_ptr()
        got = restore_candidates([(5, reader, "memory")], target, rank=0, events=events, direct=True)
        reader.close()
        assert got.step == 5 and target["model"]["w"].data_ptr() == live
        _assert_same(target, original)
        evs = list(read_events(tmp_path / "events.jsonl"))
        (bad,) = [e for e in evs if e["event"] == "restore_fallback"]
        assert bad["holder"] == "reader" and bad["tier"] == "local" and "checksum" in bad["error"]
        (ok,) = [e for e in evs if e["event"] == "restore"]
        assert ok["tier"] == "peer"


@pytest.mark.parametrize("direct", [False, True])
def test_every_copy_corrupt_falls_back_to_durable(tmp_path, direct):
    durable_url = (tmp_path / "durable").as_uri()
    with _nodes(tmp_path, ["writer", "reader"]) as (stores, servers):
        original = _state(3)
        with Snapshotter(durable_url, compress="none") as d:
            d.save(4, original, extra={"rng": None}, global_extra={"step": 4}, force=True)
        newer = _state(4)
        with Snapshotter(stores["writer"].url, commit=False, secret=SECRET, compress="none") as snap:
            snap.save(5, newer, extra={"rng": None}, global_extra={"step": 5}, force=True)
        (v,) = stores["writer"].versions()
        _flip_byte(stores["writer"].file(stores["writer"].rank_files(5, v.attempt, 0)[0]), -1, 1)
        events, reader = _reader(tmp_path, v.attempt, ["writer"], servers)
        target = _state(9)
        got = restore_candidates([(5, reader, "memory"), (4, SnapshotReader(durable_url), "durable")],
                                 target, rank=0, events=events, direct=direct)
        reader.close()
        assert got.step == 4
        _assert_same(target, original)   # (direct) read over whatever the failed version left
        evs = list(read_events(tmp_path / "events.jsonl"))
        assert [e["tier"] for e in evs if e["event"] == "restore"] == ["durable"]
        assert any(e["event"] == "restore_fallback" and e.get("tier") == "memory" and e["step"] == 5 for e in evs)
