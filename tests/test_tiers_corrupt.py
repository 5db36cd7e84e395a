"""A peer that hands back a corrupted replica: detected by the chunk CRC, reported,
and another copy (or tier) used; the bad bytes never reach the state."""

from __future__ import annotations

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


def _setup(tmp_path, nodes):
    stores = {n: NodeStore(tmp_path / "shm", "job", n) for n in nodes}
    for s in stores.values():
        s.create()
    servers = {n: PeerServer(stores[n], SECRET, host="127.0.0.1") for n in nodes}
    return stores, servers


def test_corrupt_peer_copy_is_skipped_for_another(tmp_path):
    stores, servers = _setup(tmp_path, ["writer", "b", "c", "reader"])
    try:
        original = _state(1)
        with Snapshotter(stores["writer"].url, commit=False, compress="none", chunk_bytes=2048) as snap:
            snap.save(5, original, extra={"rng": None}, global_extra={"step": 5}, force=True)
        (v,) = stores["writer"].versions()
        files = stores["writer"].rank_files(v.step, v.attempt, 0)
        for peer in ("b", "c"):  # replicate like the agent does
            with PeerClient(servers[peer].address, SECRET) as c:
                for rel in files:
                    c.put(rel, stores["writer"].read(rel))
        part = stores["b"].file(files[0])
        data = bytearray(part.read_bytes())
        data[100] ^= 0x40  # one flipped bit in b's copy, at rest
        part.write_bytes(bytes(data))

        events = EventLog(tmp_path / "events.jsonl", node="reader")
        info = StoreInfo(base=str(tmp_path / "shm"), run_id="job", node="reader", etcd="", secret_file="")
        plan = {"step": 5, "attempt": v.attempt, "world": 1, "holders": {"0": ["b", "c"]},
                "peers": {n: servers[n].address for n in ("b", "c")}}
        reader = MemoryReader(plan, info, SECRET, events)
        target = _state(2)
        got = restore_candidates([(5, reader, "memory")], target, rank=0, events=events)
        reader.close()
        assert got.step == 5
        for k in ("w", "b"):
            assert torch.equal(target["model"][k], original["model"][k])
        assert torch.equal(target["optim"]["w"]["exp_avg"], original["optim"]["w"]["exp_avg"])
        evs = list(read_events(tmp_path / "events.jsonl"))
        bad = [e for e in evs if e["event"] == "restore_fallback"]
        assert bad and bad[0]["holder"] == "b" and bad[0]["copy_skipped"] and "checksum" in bad[0]["error"]
        (ok,) = [e for e in evs if e["event"] == "restore"]
        assert ok["tier"] == "peer"
    finally:
        for s in servers.values():
            s.close()
        for s in stores.values():
            s.remove()


def test_corrupt_local_copy_read_straight_into_the_state_is_replaced_by_a_peers(tmp_path, monkeypatch):
    """``direct``: this node's copy is read into the live tensors themselves; a flipped bit
    there is caught in place, reported, and a peer's good copy written over it."""
    stores, servers = _setup(tmp_path, ["reader", "c"])
    try:
        original = _state(5)
        with Snapshotter(stores["reader"].url, commit=False, compress="none", chunk_bytes=2048) as snap:
            snap.save(5, original, extra={"rng": None}, global_extra={"step": 5}, force=True)
        (v,) = stores["reader"].versions()
        files = stores["reader"].rank_files(v.step, v.attempt, 0)
        with PeerClient(servers["c"].address, SECRET) as c:
            for rel in files:
                c.put(rel, stores["reader"].read(rel))
        part = stores["reader"].file(files[0])
        data = bytearray(part.read_bytes())
        data[100] ^= 0x08
        part.write_bytes(bytes(data))
        events = EventLog(tmp_path / "events.jsonl", node="reader")
        info = StoreInfo(base=str(tmp_path / "shm"), run_id="job", node="reader", etcd="", secret_file="")
        plan = {"step": 5, "attempt": v.attempt, "world": 1, "holders": {"0": ["reader", "c"]},
                "peers": {n: servers[n].address for n in ("reader", "c")}}
        reader = MemoryReader(plan, info, SECRET, events)
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
        for k in ("w", "b"):
            assert torch.equal(target["model"][k], original["model"][k])
        assert torch.equal(target["optim"]["w"]["exp_avg"], original["optim"]["w"]["exp_avg"])
        evs = list(read_events(tmp_path / "events.jsonl"))
        (bad,) = [e for e in evs if e["event"] == "restore_fallback"]
        assert bad["holder"] == "reader" and bad["tier"] == "local" and "checksum" in bad["error"]
        (ok,) = [e for e in evs if e["event"] == "restore"]
        assert ok["tier"] == "peer"
    finally:
        for s in servers.values():
            s.close()
        for s in stores.values():
            s.remove()


@pytest.mark.parametrize("direct", [False, True])
def test_every_copy_corrupt_falls_back_to_durable(tmp_path, direct):
    stores, servers = _setup(tmp_path, ["writer", "reader"])
    durable_url = (tmp_path / "durable").as_uri()
    try:
        original = _state(3)
        with Snapshotter(durable_url, compress="none") as d:
            d.save(4, original, extra={"rng": None}, global_extra={"step": 4}, force=True)
        newer = _state(4)
        with Snapshotter(stores["writer"].url, commit=False, compress="none") as snap:
            snap.save(5, newer, extra={"rng": None}, global_extra={"step": 5}, force=True)
        (v,) = stores["writer"].versions()
        part = stores["writer"].file(stores["writer"].rank_files(5, v.attempt, 0)[0])
        data = bytearray(part.read_bytes())
        data[-1] ^= 1
        part.write_bytes(bytes(data))
        events = EventLog(tmp_path / "events.jsonl", node="reader")
        info = StoreInfo(base=str(tmp_path / "shm"), run_id="job", node="reader", etcd="", secret_file="")
        plan = {"step": 5, "attempt": v.attempt, "world": 1, "holders": {"0": ["writer"]},
                "peers": {"writer": servers["writer"].address}}
        reader = MemoryReader(plan, info, SECRET, events)
        target = _state(9)
        got = restore_candidates([(5, reader, "memory"), (4, SnapshotReader(durable_url), "durable")],
                                 target, rank=0, events=events, direct=direct)
        reader.close()
        assert got.step == 4
        for k in ("w", "b"):   # read over whatever the failed version left (direct)
            assert torch.equal(target["model"][k], original["model"][k])
        assert torch.equal(target["optim"]["w"]["exp_avg"], original["optim"]["w"]["exp_avg"])
        evs = list(read_events(tmp_path / "events.jsonl"))
        assert [e["tier"] for e in evs if e["event"] == "restore"] == ["durable"]
        assert any(e["event"] == "restore_fallback" and e.get("tier") == "memory" and e["step"] == 5 for e in evs)
    finally:
        for s in servers.values():
            s.close()
        for s in stores.values():
            s.remove()
