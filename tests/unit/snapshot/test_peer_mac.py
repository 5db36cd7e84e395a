"""Peer channel integrity in flight: a flipped bit anywhere after the handshake (a header,
a payload byte, a tag) is caught by the frame MAC, in both directions, and frames cannot
be replayed from another connection or reordered."""

from __future__ import annotations

import socket
import threading
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.secret import JobSecret
from resilient.snapshot.api import SnapshotIncomplete
from resilient.snapshot.peer import (
    PIECE,
    TAG,
    PeerClient,
    PeerError,
    PeerServer,
    PeerTampered,
    _Channel,
)

REL = "step-000000000007/abc123-000001/r00003-p0000.bin"
SECRET = bytes(range(32))  # the peer_server fixture's (conftest.py)
PAYLOAD = bytes(range(256)) * 600  # 150 KiB: one piece


class FlipProxy:
    """Forwards one connection at a time to ``upstream``; flips bit 0 of the byte at offset
    ``flip`` of the ``direction`` stream ("c2s" or "s2c"), counted from the connection's
    start. Counts the bytes of each direction (a clean run measures the layout)."""

    def __init__(self, upstream: tuple[str, int], direction: str = "c2s", flip: int | None = None):
        self.upstream, self.direction, self.flip = upstream, direction, flip
        self.counts = {"c2s": 0, "s2c": 0}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.socks: list[socket.socket] = [self.listener]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(self.upstream)
        self.socks += [client, server]
        for src, dst, d in ((client, server, "c2s"), (server, client, "s2c")):
            t = threading.Thread(target=self._pump, args=(src, dst, d), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while data := src.recv(65536):
                start = self.counts[direction]
                self.counts[direction] += len(data)
                if direction == self.direction and self.flip is not None and start <= self.flip < start + len(data):
                    buf = bytearray(data)
                    buf[self.flip - start] ^= 1
                    data = bytes(buf)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for s in self.socks:  # shutdown wakes a thread blocked in recv/accept; close alone does not
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self.threads:
            t.join(5)


def _through_proxy(srv: PeerServer, call, direction: str = "c2s", flip: int | None = None) -> tuple[dict, object]:
    """``call(client)`` on a client connected through a FlipProxy; the byte counts and the
    result (or the PeerError)."""
    host, _, port = srv.address.rpartition(":")
    proxy = FlipProxy((host, int(port)), direction, flip)
    try:
        with PeerClient(proxy.address, SECRET) as c:
            try:
                result = call(c)
            except PeerError as e:
                result = e
    finally:
        proxy.close()
    return dict(proxy.counts), result


def _exchange(srv: PeerServer, op: str, direction: str = "c2s", flip: int | None = None) -> tuple[dict, object]:
    """One put or get through the proxy; returns the byte counts and the result (or the error)."""
    return _through_proxy(srv, lambda c: c.put(REL, PAYLOAD) if op == "put" else c.get(REL), direction, flip)


@pytest.mark.parametrize("where", ["header", "payload start", "payload end", "tag"])
def test_a_flipped_bit_in_a_put_is_caught_and_nothing_is_stored(peer_server, where):
    store, srv = peer_server
    counts, ok = _exchange(srv, "put")  # clean run: the layout of the client's stream
    assert ok is None and store.read(REL) == PAYLOAD
    store.file(REL).unlink()
    total = counts["c2s"]
    payload_at = total - TAG - len(PAYLOAD)
    offset = {"header": payload_at - 40, "payload start": payload_at, "payload end": total - TAG - 1,
              "tag": total - 1}[where]
    _, err = _exchange(srv, "put", "c2s", offset)
    assert isinstance(err, PeerError)
    assert not store.file(REL).exists()
    with PeerClient(srv.address, SECRET) as c:  # the server lives on for honest clients
        c.put(REL, PAYLOAD)
        assert c.get(REL, 7, 5) == PAYLOAD[7:12]


@pytest.mark.parametrize("where", ["header", "payload start", "payload end", "tag"])
def test_a_flipped_bit_in_a_get_is_caught(peer_server, where):
    store, srv = peer_server
    with PeerClient(srv.address, SECRET) as c:
        c.put(REL, PAYLOAD)
    counts, got = _exchange(srv, "get")
    assert got == PAYLOAD
    total = counts["s2c"]
    payload_at = total - TAG - len(PAYLOAD)
    offset = {"header": payload_at - 40, "payload start": payload_at, "payload end": total - TAG - 1,
              "tag": total - 1}[where]
    _, err = _exchange(srv, "get", "s2c", offset)
    assert isinstance(err, PeerError), err
    if where != "header":  # a bad header may also read as a malformed one; a payload byte is named
        assert "tampered" in str(err)


def _pair(secret: JobSecret, cn: bytes, sn: bytes) -> tuple[_Channel, _Channel, socket.socket, socket.socket]:
    a, b = socket.socketpair()
    return (_Channel.after_handshake(a, secret, cn, sn, server=False),
            _Channel.after_handshake(b, secret, cn, sn, server=True), a, b)


def test_frames_cannot_be_replayed_from_another_connection_or_reordered():
    secret = JobSecret(SECRET)
    sender, receiver, a, b = _pair(secret, b"c" * 32, b"s" * 32)
    try:
        # frames recorded on one connection...
        sender.send({"op": "get", "path": REL})
        sender.send({"op": "put", "path": REL, "size": 3, "crc": 0}, b"abc")
        recorded = b.recv(65536)
        first_len = 4 + int.from_bytes(recorded[:4], "big") + TAG
        header1, header2_and_piece = recorded[:first_len], recorded[first_len:]
        # ...do not verify on another connection (other nonces: another key)
        _, other_receiver, c, d = _pair(secret, b"C" * 32, b"S" * 32)
        try:
            c.sendall(header1)
            with pytest.raises(PeerTampered):
                other_receiver.recv_header()
        finally:
            c.close()
            d.close()
        # ...nor out of order on their own (a fresh receiver expects frame 0 first)
        _, fresh, e, f = _pair(secret, b"c" * 32, b"s" * 32)
        try:
            e.sendall(header2_and_piece)
            with pytest.raises(PeerTampered):
                fresh.recv_header()
        finally:
            e.close()
            f.close()
        # in order, on their own connection, they verify
        a2, b2 = socket.socketpair()
        try:
            ok = _Channel.after_handshake(b2, secret, b"c" * 32, b"s" * 32, server=True)
            a2.sendall(recorded)
            assert ok.recv_header()["op"] == "get"
            assert ok.recv_header()["size"] == 3
            assert ok.recv_payload(3) == b"abc"
        finally:
            a2.close()
            b2.close()
    finally:
        a.close()
        b.close()


def test_pieces_are_tagged_one_by_one(peer_server):
    """A payload over one piece (PIECE bytes) goes out as several tagged frames and comes back whole."""
    store, srv = peer_server
    big = bytes(range(251)) * ((PIECE * 2 + 1000) // 251)
    with PeerClient(srv.address, SECRET) as c:
        c.put(REL, big)
        assert c.get(REL) == big
        # sent: the put header, 3 pieces, the get header; received: the put reply, the get reply, 3 pieces
        assert c.chan.sent == 5 and c.chan.received == 5


def test_a_truncated_push_stores_nothing_and_a_recorded_one_cannot_be_replayed(peer_server):
    """A put cut off mid-payload (the sender died, the link dropped) leaves no file; the bytes of a
    whole put recorded off the wire and sent again on a new connection are refused at its handshake."""
    store, srv = peer_server
    host, _, port = srv.address.rpartition(":")
    # truncated: the header promises the whole payload, half of it comes, then the connection ends
    with PeerClient(srv.address, SECRET) as c:
        c.chan.send({"op": "put", "path": REL, "size": len(PAYLOAD), "crc": 0})
        half = memoryview(PAYLOAD)[:len(PAYLOAD) // 2]
        c.sock.sendall(half)
    with PeerClient(srv.address, SECRET) as c:  # the server lives on; nothing was stored
        with pytest.raises(SnapshotIncomplete):
            c.get(REL)
    assert not store.file(REL).exists()
    # replayed: a proxy records a genuine put; its bytes sent again on a fresh connection
    proxy = FlipProxy((host, int(port)))
    recorded = bytearray()
    real_pump = proxy._pump

    def recording(src, dst, direction):
        if direction == "c2s":
            while data := src.recv(65536):
                recorded.extend(data)
                dst.sendall(data)
            return
        real_pump(src, dst, direction)

    proxy._pump = recording
    try:
        with PeerClient(proxy.address, SECRET) as c:
            c.put(REL, PAYLOAD)
    finally:
        proxy.close()
    store.file(REL).unlink()
    import socket as _socket
    with _socket.create_connection((host, int(port)), timeout=10) as s:
        s.settimeout(10)
        s.sendall(bytes(recorded))
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass
    assert not store.file(REL).exists(), "a replayed push was stored"


# -- vouched puts: the pieces untagged, checked against the chunk MACs of the capture ----------
STEP, ATTEMPT = 7, "abc123-000001"     # REL's version
CUTS = [0, 40000, 40000, 100000, len(PAYLOAD)]   # four chunks, one empty


def _vouch(step: int = STEP, attempt: str = ATTEMPT, cuts: list[int] = CUTS) -> list[list]:
    """The chunk list a push sends for PAYLOAD: each chunk's MAC as its rank computed it."""
    from resilient.snapshot.auth import VersionAuth

    auth = VersionAuth(SECRET)
    return [[a, b - a, auth.chunk_mac(step, attempt, PAYLOAD[a:b])] for a, b in pairwise(cuts)]


def _put_vouched(srv: PeerServer, tmp_path, macs: list[list], flip: int | None = None) -> tuple[dict, object]:
    from resilient.snapshot.format import crc

    src = tmp_path / "part.bin"
    src.write_bytes(PAYLOAD)
    return _through_proxy(srv, lambda c: c.put_file(REL, src, (crc(PAYLOAD), len(PAYLOAD)), macs), "c2s", flip)


@pytest.mark.parametrize("where", ["header", "payload start", "second chunk", "payload end"])
def test_a_vouched_put_goes_untagged_and_a_flipped_bit_is_refused(peer_server, tmp_path, where):
    """A push of a part whose chunks carry MACs sends them in its (tagged) header and the
    pieces untagged; the peer checks the bytes against the chunk MACs as they arrive. A bit
    flipped in flight anywhere is refused (the header by its tag, the payload by the MAC of
    the chunk it struck), and nothing is stored."""
    store, srv = peer_server
    counts, ok = _put_vouched(srv, tmp_path, _vouch())
    assert ok == len(PAYLOAD) and store.read(REL) == PAYLOAD
    store.file(REL).unlink()
    payload_at = counts["c2s"] - len(PAYLOAD)   # no tag after the payload: it went untagged
    offset = {"header": payload_at - 40, "payload start": payload_at, "second chunk": payload_at + 40000 + 5,
              "payload end": counts["c2s"] - 1}[where]
    _, err = _put_vouched(srv, tmp_path, _vouch(), flip=offset)
    assert isinstance(err, PeerError), err
    if where != "header":
        assert "refused" in str(err) and "chunk's MAC" in str(err), err
        struck = 0 if where == "payload start" else 40000 if where == "second chunk" else 100000
        assert f"from byte {struck} on" in str(err), err
    assert not store.file(REL).exists()


@pytest.mark.parametrize("other", ["step", "attempt"])
def test_a_vouched_put_of_another_versions_bytes_is_refused(peer_server, tmp_path, other):
    """Chunk MACs verify under the key of the version the part is stored in: a part of
    another step or attempt (its own MACs, genuine) cannot be stored as this one's."""
    store, srv = peer_server
    macs = _vouch(step=STEP + 1) if other == "step" else _vouch(attempt="abc123-000002")
    _, err = _put_vouched(srv, tmp_path, macs)
    assert isinstance(err, PeerError) and "chunk's MAC" in str(err), err
    assert not store.file(REL).exists()


@pytest.mark.parametrize("bad", ["gap", "short", "not a mac", "not a list"])
def test_a_vouched_put_with_a_malformed_chunk_list_is_dropped(peer_server, tmp_path, bad):
    """A chunk list that does not tile the part, or is not one: the untagged payload behind it
    cannot be read safely, so the connection is dropped; nothing is stored, the server serves on."""
    store, srv = peer_server
    macs = _vouch()
    macs = {"gap": lambda: [macs[0], macs[1], macs[3]], "short": lambda: macs[:-1],
            "not a mac": lambda: [*macs[:-1], [macs[-1][0], macs[-1][1], "crc32c:00000000"]],
            "not a list": lambda: {"chunks": macs}}[bad]()
    _, err = _put_vouched(srv, tmp_path, macs)
    assert isinstance(err, PeerError), err
    assert not store.file(REL).exists()
    with PeerClient(srv.address, SECRET) as c:
        c.put(REL, PAYLOAD)
        assert c.get(REL) == PAYLOAD


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8), piece=st.integers(1, 4000),
       flip=st.one_of(st.none(), st.integers(0, 10 ** 6)))
def test_the_chunk_stream_checks_any_cut_of_pieces_and_names_the_struck_chunk(sizes, piece, flip):
    """However the pieces cut the chunks (a chunk across pieces, many in one, empty ones), the
    stream verifies intact bytes, and a flipped byte fails the chunk it is in, named by its start."""
    from resilient.snapshot.auth import ChunkStream, VersionAuth

    auth = VersionAuth(SECRET)
    data = bytearray(PAYLOAD[:sum(sizes)])
    cuts = [0]
    for n in sizes:
        cuts.append(cuts[-1] + n)
    chunks = [[a, b - a, auth.chunk_mac(STEP, ATTEMPT, bytes(data[a:b]))] for a, b in pairwise(cuts)]
    struck = None
    if flip is not None and data:
        at = flip % len(data)
        data[at] ^= 0x10
        struck = max(a for a, b in pairwise(cuts) if a <= at < b)
    stream = ChunkStream(auth, STEP, ATTEMPT, chunks, len(data))
    view = memoryview(bytes(data))
    for i in range(0, len(data), piece):
        stream.feed(i, view[i:i + piece])
    assert stream.ok() is (struck is None)
    assert stream.bad == struck
