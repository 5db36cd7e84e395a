"""Peer RAM channel: only holders of the job secret can read or write a node store;
every transfer is checksummed; replica targets prefer other failure domains."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from resilient.snapshot.format import crc
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerAuthError, PeerClient, PeerError, PeerServer, peer_order

REL = "step-000000000007/abc123-000001/r00003-p0000.bin"
SECRET = bytes(range(32))


def test_member_writes_and_reads_ranges(peer_server):
    store, srv = peer_server
    with PeerClient(srv.address, SECRET) as c:
        c.put(REL, b"0123456789" * 1000)
        assert c.get(REL, 5, 7) == b"5678901"
        assert c.get(REL) == b"0123456789" * 1000
    assert store.read(REL, 10, 3) == b"012"


def test_without_the_secret_nothing_is_read_or_written(peer_server):
    store, srv = peer_server
    with PeerClient(srv.address, SECRET) as c:
        c.put(REL, b"payload")
    with pytest.raises(PeerAuthError):
        PeerClient(srv.address, b"x" * 32)
    # A raw client that skips the handshake and sends a put/get gets nothing done.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.recv(4096)  # the server's challenge
        other = "step-000000000007/abc123-000001/r00004-p0000.bin"
        for hdr in ({"op": "put", "path": other, "size": 4, "crc": crc(b"evil")},
                    {"op": "get", "path": REL}):
            data = json.dumps(hdr).encode()
            try:
                s.sendall(struct.pack("!I", len(data)) + data + b"evil")
            except OSError:
                break
        reply = s.recv(65536)
        assert b"payload" not in reply and b"authentication failed" in reply
    assert not store.file(other).exists()
    assert store.read(REL) == b"payload"


def test_client_refuses_a_server_without_the_secret(tmp_path):
    store = NodeStore(tmp_path, "job", "impostor")
    store.create()
    srv = PeerServer(store, b"y" * 32, host="127.0.0.1")
    try:
        with pytest.raises(PeerAuthError):
            PeerClient(srv.address, SECRET)
    finally:
        srv.close()
        store.remove()


def test_bad_paths_and_missing_objects(peer_server):
    store, srv = peer_server
    with PeerClient(srv.address, SECRET) as c:
        with pytest.raises(PeerError):
            c.put("../../etc/passwd", b"x")
    with PeerClient(srv.address, SECRET) as c:
        from resilient.snapshot.api import SnapshotIncomplete

        with pytest.raises(SnapshotIncomplete):
            c.get("step-000000000001/abc-000000/r00000.json")


def test_peer_order_prefers_other_domains():
    nodes = {"a": {"domain": "r1"}, "b": {"domain": "r1"}, "c": {"domain": "r2"}, "d": {"domain": "r2"}}
    assert peer_order("a", nodes, 1) == ["c"]
    assert peer_order("b", nodes, 2) == ["c", "d"]
    assert peer_order("c", nodes, 1) == ["a"]
    assert peer_order("a", {"a": {"domain": "r1"}, "b": {"domain": "r1"}}, 1) == ["b"]  # fallback
    assert peer_order("a", {"a": {}}, 1) == []


def test_the_peer_server_listens_where_peers_are_told_not_on_every_interface(tmp_path):
    """Default (``snapshot.store_host = ""``): bound to the address it advertises (this host's
    name's), so another network of the host never sees the port; an address that is not this
    host's is a typed error naming the knob."""
    from resilient.snapshot.api import StorageError
    from resilient.snapshot.config import SnapshotConfig

    assert SnapshotConfig().store_host == ""
    store = NodeStore(tmp_path / "shm", "job", "n0")
    store.create()
    try:
        srv = PeerServer(store, SECRET)
        try:
            bound = srv._srv.socket.getsockname()[0]
            assert bound not in ("0.0.0.0", "::") and srv.address == f"{bound}:{srv.port}"
            with PeerClient(srv.address, SECRET) as c:   # where peers are told, it answers
                c.put(REL, b"x")
        finally:
            srv.close()
        with pytest.raises(StorageError, match="snapshot.store_host"):
            PeerServer(store, SECRET, host="192.0.2.1")   # TEST-NET-1: never this host's
    finally:
        store.remove()
