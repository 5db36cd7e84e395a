"""Peer RAM: an authenticated TCP channel between node stores.

Each agent runs a :class:`PeerServer` on its node store. Peers *push*
replicas (``put``) and restoring workers *pull* byte ranges (``get``).

Authentication: the job secret (:mod:`resilient.secret`; it never passes
through etcd and is never sent). On connect both sides prove they hold it,
HMAC-SHA256 challenge-response over fresh nonces in both directions, so a
process without the secret can neither read nor write a store, and a client
never takes bytes from a server that cannot prove membership.

Integrity in flight: after the handshake every frame (each request and reply
header, and each ``PIECE`` of a payload) is followed by an AES-GMAC tag under a
per-connection key (derived from the secret and both nonces) whose nonce is the
frame's direction and sequence number, so a frame cannot be altered, replayed on
another connection, reordered or cut without the receiver noticing; a receiver
drops the connection at the first bad tag (a ``put`` is then not stored, a
``get`` fails and the reader tries another holder). A replica's part is the
exception: its header carries the MACs its rank gave each chunk at capture, and
its pieces come untagged, checked against those as they arrive (``put_file``,
:class:`~resilient.snapshot.auth.ChunkStream`): as strong (a chunk MAC is keyed by
the version, so bytes of another version or a changed byte fail), and the sender
no longer reads the bytes at all (a 256 MB push: 259-281 → 183-207 ms of CPU for
both ends, ``bench/push_cost.py`` side by side). Cost: one GMAC pass per byte
on each side, near memory speed (OpenSSL's AES-NI/PCLMUL code; it was
HMAC-SHA256 before, 0.6-0.9 CPU-s per GB per side: ``bench/push_cost.py`` and
``bench/RESULTS.md`` have the push cost side by side). Payloads are not
encrypted: snapshots are training state, not credentials; keep the fleet network
isolated as usual. What a pushed version *is* is authenticated apart from the
channel: its rank manifest is signed and each chunk carries its own MAC
(:mod:`.auth`), checked by whoever restores from it.

Integrity at rest: a ``put`` carries the CRC-32C the part had when its rank
captured it (combined from the rank manifest's chunk CRCs), checked by the
receiver before the file is renamed into place: a part damaged in the
sender's store is refused, never replicated. The format's per-chunk CRCs are
checked again by the reader, so a replica corrupted at rest on a peer is
caught too (:class:`SnapshotCorrupt`).

Framing: ``u32 length`` + JSON header (+ tag), then ``header["size"]`` raw
bytes in pieces (+ a tag each). Nothing is ever unpickled.

Where it listens: on the address peers are told, by default this host's address (what
its hostname resolves to; ``snapshot.store_host = ""``), not on every interface: peers on
other machines push replicas here and restoring workers there read from it, so it must
be reachable where they are told, and nowhere else (a management or public network
beside the fleet's never sees the port). ``snapshot.store_host`` names another address
(the fleet's interface where the hostname resolves elsewhere), or ``0.0.0.0`` for every
interface. Either way the handshake above is what keeps everyone else out (a connection
that cannot prove the secret is closed before any request is read).
"""

from __future__ import annotations

import hmac
import json
import logging
import mmap
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from resilient.secret import PEER, JobSecret
from resilient.snapshot.api import SnapshotCorrupt, SnapshotError, SnapshotIncomplete, StorageError
from resilient.snapshot.auth import ChunkStream, VersionAuth
from resilient.snapshot.format import crc, parse_version_dir
from resilient.snapshot.nodestore import NodeStore, check_rel
from resilient.snapshot.priority import REPLICATION_NICE, background_priority

log = logging.getLogger(__name__)

MAX_HEADER = 64 << 10
MAX_HOLDS = 64 << 20     # a holds report: a node's rank manifests, JSON
# Bytes per send/receive call and rate-limit tick: 4 MiB pushes cost ~7% less CPU than
# 1 MiB ones (bench/push_cost.py, 6 of 7 pairs side by side).
PIECE = 4 << 20


class PeerAuthError(SnapshotError):
    """A peer did not prove it holds the job secret (or we do not hold it).

    Every node of a job must hold the same secret (:mod:`resilient.secret`:
    ``--secret-file``, ``$RESILIENT_JOB_SECRET_FILE`` or ``$RESILIENT_JOB_SECRET``)."""


class PeerError(StorageError):
    """A peer could not be reached or refused a request; the reader tries another copy."""


class PeerTampered(ConnectionError):
    """A frame's tag did not verify: the bytes were changed, replayed or reordered in flight.
    The connection is dropped (a ConnectionError: nothing more can be trusted on it)."""


TAG = 16  # bytes of an AES-GMAC tag


def _mac(secret: JobSecret, *parts: bytes) -> str:
    return secret.mac(PEER, *parts).hex()


class _Channel:
    """One direction pair of an authenticated connection: every frame sent carries a tag over
    (direction, sequence number, bytes) under the connection's key; every frame received is
    checked before it is used. ``out``/``inn``: this side's direction labels."""

    def __init__(self, sock: socket.socket, key: bytes, out: bytes, inn: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.sock, self.out, self.inn = sock, out, inn
        self._gmac = AESGCM(key[:16])
        self.sent = self.received = 0

    @classmethod
    def after_handshake(cls, sock: socket.socket, secret: JobSecret, client_nonce: bytes, server_nonce: bytes,
                        server: bool) -> "_Channel":
        key = secret.mac(PEER, b"session", client_nonce, server_nonce)
        return cls(sock, key, b"s2c", b"c2s") if server else cls(sock, key, b"c2s", b"s2c")

    def _tag(self, direction: bytes, seq: int, data: bytes | memoryview | mmap.mmap) -> bytes:
        # AES-GMAC: the nonce is the direction and the frame's number, never repeated under a
        # connection's key (itself fresh per connection: both nonces of the handshake).
        return self._gmac.encrypt(direction + b"\0" + struct.pack("!Q", seq), b"", data)

    def tag_out(self, data: bytes | memoryview | mmap.mmap) -> bytes:
        """The tag of the next frame sent (call once per frame, in order)."""
        t = self._tag(self.out, self.sent, data)
        self.sent += 1
        return t

    def _check(self, data: bytes | memoryview, tag: bytes) -> None:
        want = self._tag(self.inn, self.received, data)
        self.received += 1
        if not hmac.compare_digest(want, tag):
            raise PeerTampered(f"frame {self.received - 1} from the peer failed its MAC (changed, replayed or "
                               "reordered in flight)")

    def send(self, header: dict, payload: bytes | memoryview | None = None) -> None:
        data = json.dumps(header).encode()
        self.sock.sendall(struct.pack("!I", len(data)) + data + self.tag_out(data))
        if payload is not None:
            view = memoryview(payload).cast("B")
            for i in range(0, len(view), PIECE):
                piece = view[i:i + PIECE]
                self.sock.sendall(piece)
                self.sock.sendall(self.tag_out(piece))

    def recv_header(self) -> dict:
        (n,) = struct.unpack("!I", _recv_exact(self.sock, 4))
        if n > MAX_HEADER:
            raise ConnectionError(f"header of {n} bytes")
        data = _recv_exact(self.sock, n)
        self._check(data, _recv_exact(self.sock, TAG))
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ConnectionError("header is not an object")
        return doc

    def recv_piece(self, view: memoryview) -> None:
        """Fill ``view`` (one piece, as the sender cut it) and check its tag."""
        _recv_into(self.sock, view)
        self._check(view, _recv_exact(self.sock, TAG))

    def recv_payload(self, size: int) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        for i in range(0, size, PIECE):
            self.recv_piece(view[i:i + PIECE])
        return bytes(buf)

    def discard(self, n: int, tagged: bool = True) -> None:
        """Read, check (``tagged`` pieces) and drop the ``n`` payload bytes left (from a
        piece boundary)."""
        scratch = memoryview(bytearray(max(0, min(n, PIECE))))
        while n > 0:
            k = min(n, PIECE)
            if tagged:
                self.recv_piece(scratch[:k])
            else:
                _recv_into(self.sock, scratch[:k])
            n -= k


def _send(sock: socket.socket, header: dict, payload: bytes | memoryview | None = None) -> None:
    data = json.dumps(header).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)
    if payload is not None:
        sock.sendall(payload)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, PIECE))
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_header(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise ConnectionError(f"header of {n} bytes")
    doc = json.loads(_recv_exact(sock, n))
    if not isinstance(doc, dict):
        raise ConnectionError("header is not an object")
    return doc


# ------------------------------------------------------------------ server
class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock, owner = self.request, self.server.owner
        # A reply is a header then a payload, two sends: without NODELAY the payload waits
        # for the ACK of the header, which the client delays by up to 40 ms per request.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(owner.io_timeout.total_seconds())
        try:
            chan = self._auth(sock, owner.secret)
            if chan is None:
                return
            while True:
                try:
                    req = chan.recv_header()
                except PeerTampered as e:
                    log.warning("peer connection from %s dropped: %s", self.client_address, e)
                    return
                except ConnectionError:
                    return
                if owner.closed:  # a request that arrives after close() is not served
                    return
                self._serve(chan, owner.store, req)
        except PeerTampered as e:
            log.warning("peer connection from %s dropped: %s", self.client_address, e)
        except (OSError, ValueError) as e:
            log.debug("peer connection ended: %s", e)

    def _auth(self, sock: socket.socket, secret: JobSecret) -> _Channel | None:
        nonce = secrets.token_bytes(32)
        _send(sock, {"nonce": nonce.hex()})
        hello = _recv_header(sock)
        theirs = bytes.fromhex(str(hello.get("nonce", "")))
        mac = str(hello.get("mac", "")).encode("utf-8", "replace")  # compare_digest refuses non-ASCII str
        if len(theirs) != 32 or not hmac.compare_digest(mac, _mac(secret, b"client", nonce).encode()):
            _send(sock, {"ok": False, "error": "authentication failed: wrong job secret"})
            return None
        _send(sock, {"ok": True, "mac": _mac(secret, b"server", theirs, nonce)})
        return _Channel.after_handshake(sock, secret, theirs, nonce, server=True)

    def _serve(self, chan: _Channel, store: NodeStore, req: dict) -> None:
        op = req.get("op")
        if op == "holds":  # a node reporting what it holds to this node, its commit leader
            self._holds(chan, req)
            return
        if op == "target":  # a node asking this node, its commit leader, which version it commits
            handler = self.server.owner.on_target
            chan.send({"ok": True, **handler(req)} if handler is not None
                      else {"ok": False, "error": "this node leads no commit"})
            return
        try:
            rel = check_rel(req.get("path"))
        except ValueError as e:
            if op == "put":  # the payload is still on the wire: the stream is unusable
                raise ConnectionError(str(e)) from None
            chan.send({"ok": False, "error": str(e)})
            return
        if op == "put":
            # Receiving a replica must not stall this node's training. Only puts: a get is a
            # peer restoring, and the whole job waits for it. (Lowered once: an unprivileged
            # thread cannot raise its priority again.)
            if not getattr(self, "_niced", False):
                background_priority(REPLICATION_NICE)
                self._niced = True
            size, sent_crc = int(req["size"]), int(req["crc"])
            # Pieces vouched for by the chunk MACs in the header come untagged (put_file).
            stream = self._chunk_stream(rel, req["chunks"], size) if "chunks" in req else None
            w = None
            try:
                w = store.writer(rel)
                if stream is None:
                    w.receive(size, chan.recv_piece, PIECE)
                    w.commit(size, sent_crc)
                else:
                    w.receive(size, lambda view: _recv_into(chan.sock, view), PIECE, check=stream.feed)
                    if not stream.ok():
                        raise SnapshotCorrupt(
                            f"{rel}: the bytes from byte {stream.bad} on do not match their chunk's MAC "
                            "(damaged in the sender's store, or changed in flight): not stored", rel)
                    w.commit(size, None)
            except BaseException as e:
                if w is not None:
                    w.abort()
                if isinstance(e, (ConnectionError, socket.timeout)):  # PeerTampered included
                    raise
                # A full store fails before the payload is read: read past it, or the
                # refusal is lost (the client would see a reset, not why).
                chan.discard(size - (w.size if w is not None else 0), tagged=stream is None)
                chan.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
                return
            chan.send({"ok": True})
        elif op == "get":
            try:
                data = store.read(rel, int(req.get("offset", 0)), req.get("length"))
            except SnapshotError as e:
                chan.send({"ok": False, "error": str(e), "missing": True})
                return
            chan.send({"ok": True, "size": len(data)}, data)
        else:
            chan.send({"ok": False, "error": f"unknown op {op!r}"})


    def _chunk_stream(self, rel: str, chunks: Any, size: int) -> ChunkStream:
        """The check of a put's untagged pieces against the chunk MACs its header carries, under
        the key of the version ``rel`` is stored in (its step and attempt directories). A list
        that does not fit is a broken stream (its untagged payload cannot be told from the
        next frame): the connection is dropped."""
        parts = rel.split("/")
        step = parse_version_dir(parts[0]) if len(parts) == 3 else None
        try:
            if step is None:
                raise ValueError(f"{rel} is no version's part")
            if getattr(self, "_auth_keys", None) is None:   # this connection's (its keys are cached)
                self._auth_keys = VersionAuth(self.server.owner.secret)
            return ChunkStream(self._auth_keys, step, parts[1], chunks, size)
        except ValueError as e:
            raise ConnectionError(f"put {rel}: {e}") from None

    def _holds(self, chan: _Channel, req: dict) -> None:
        size = int(req.get("size", -1))
        if not 0 <= size <= MAX_HOLDS:
            raise ConnectionError(f"holds report of {size} bytes")  # the stream is unusable
        doc = json.loads(chan.recv_payload(size))
        handler = self.server.owner.on_holds
        if handler is None or not isinstance(doc, dict):
            chan.send({"ok": False, "error": "this node collects no holds"})
            return
        chan.send({"ok": True, **handler(doc)})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: the commit leader meets every node's first report
    # at once, and connections past the backlog hung in their handshake (measured with 64
    # simulated nodes, bench/scale.py: "handshake failed (timed out)", versions uncommitted).
    request_queue_size = 1024
    owner: "PeerServer"


class PeerServer:
    """Serves one node store to authenticated peers, on a free port, in daemon threads."""

    def __init__(self, store: NodeStore, secret: JobSecret | bytes, host: str = "",
                 advertise: str = "", io_timeout: timedelta = timedelta(seconds=30)):
        self.store, self.secret, self.io_timeout = store, JobSecret.of(secret), io_timeout
        self.closed = False
        # Set by the node's replicator (memcommit): takes a peer's holds report, returns the reply;
        # takes a peer's question of which version this node's commit gathers, returns the answer.
        self.on_holds: Callable[[dict], dict] | None = None
        self.on_target: Callable[[dict], dict] | None = None
        bind = host or _default_host(host)   # "": where peers are told
        try:
            self._srv = _Server((bind, 0), _Handler)
        except OSError as e:
            raise StorageError(f"the node store's peer server cannot listen on {bind} ({e.strerror}): "
                               + ("this host's name resolves to an address that is not its own; " if not host else "")
                               + "set snapshot.store_host to the address peers reach this host at (0.0.0.0: every "
                               "interface)", bind) from None
        self._srv.owner = self
        self.port = self._srv.server_address[1]
        self.address = f"{advertise or _default_host(host)}:{self.port}"
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="peer-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.closed = True
        self._srv.shutdown()
        self._srv.server_close()
        self._thread.join(5)


def _default_host(bound: str) -> str:
    if bound not in ("0.0.0.0", "", "::"):
        return bound
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# ------------------------------------------------------------------ client
class PeerClient:
    """One authenticated connection to a peer's store. Not thread-safe: one per thread.

    ``rate``: bytes/s cap for :meth:`put` (0 = unlimited), so replication
    shares the link with training instead of saturating it."""

    def __init__(self, address: str, secret: JobSecret | bytes, timeout: timedelta = timedelta(seconds=30),
                 rate: float = 0.0):
        self.address, self.rate = address, rate
        secret = JobSecret.of(secret)
        host, _, port = address.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout.total_seconds())
        except OSError as e:
            raise PeerError(f"peer {address}: cannot connect ({e})", address) from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = _recv_header(self.sock)
            nonce = bytes.fromhex(hello["nonce"])
            mine = secrets.token_bytes(32)
            _send(self.sock, {"mac": _mac(secret, b"client", nonce), "nonce": mine.hex()})
            reply = _recv_header(self.sock)
        except (OSError, ValueError, KeyError) as e:
            self.close()
            raise PeerError(f"peer {address}: handshake failed ({e})", address) from None
        if not reply.get("ok") or not hmac.compare_digest(str(reply.get("mac", "")),
                                                          _mac(secret, b"server", mine, nonce)):
            self.close()
            raise PeerAuthError(f"peer {address}: mutual authentication failed "
                                f"({reply.get('error', 'the server does not hold the job secret')})", address)
        self.chan = _Channel.after_handshake(self.sock, secret, mine, nonce, server=False)

    def put(self, rel: str, data: bytes | memoryview) -> None:
        """Store ``data`` as ``rel`` on the peer, atomically; raises :class:`PeerError`."""
        view = memoryview(data).cast("B")

        def send(i: int, n: int) -> None:
            self.sock.sendall(view[i:i + n])
            self.sock.sendall(self.chan.tag_out(view[i:i + n]))

        self._put(rel, len(view), crc(view), send)

    def put_file(self, rel: str, path: str | os.PathLike, expect: tuple[int, int] | None = None,
                 macs: list[list] | None = None) -> int:
        """Store the local file ``path`` as ``rel`` on the peer, like :meth:`put`; returns its size.

        Why not ``put(rel, read(path))``: a replica is pushed every version, and a read
        into a Python buffer is one more copy of the state per push. The bytes go out with
        ``sendfile`` (the kernel copies from the page cache to the socket).

        ``expect``: the ``(CRC-32C, size)`` the file must have (from its rank manifest's
        chunks, :func:`~resilient.snapshot.format.object_crcs`). A file of another size is
        :class:`SnapshotCorrupt` here; the peer checks the bytes it receives against the
        CRC, so a copy damaged in this store is refused there, and the file is not read
        once more to checksum it. Without it, the checksum is taken over a read-only
        mapping of the file.

        ``macs``: the file's chunks with the MACs its rank computed at capture
        (:func:`~resilient.snapshot.auth.object_macs`). Given, they travel in the (tagged)
        header and the pieces go out untagged: the peer checks the bytes against them as they
        arrive (:class:`~resilient.snapshot.auth.ChunkStream`), which authenticates them from
        the capture on, and this side never reads them (the push's sender-side MAC pass
        gone: ``bench/bench_passes.py``). Without them (a part no manifest vouches for, a
        chunk list too long for a header) every piece carries the channel's tag."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise SnapshotIncomplete(f"{path}: not in this node's store", str(path)) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if expect is not None and size != expect[1]:
                raise SnapshotCorrupt(f"{path}: {size} bytes in this node's store, its rank manifest's "
                                      f"chunks add up to {expect[1]}: damaged, not replicated", str(path))
            header = {"chunks": macs} if macs is not None else {}
            if macs is not None and len(json.dumps(macs)) > MAX_HEADER // 2:
                header = {}   # thousands of chunks in one part: tagged pieces instead
            if header and expect is not None:
                def send_untagged(i: int, n: int) -> None:
                    if self.sock.sendfile(f, i, n) != n:
                        raise OSError(f"{path} shrank while being sent")

                self._put(rel, size, expect[0], send_untagged, header)
                return size
            # The tags are taken over a read-only mapping (the page cache, no copy); the bytes
            # go out with sendfile. Store files are immutable once named.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
            try:
                value = expect[0] if expect is not None else (crc(mm) if mm is not None else 0)

                def send(i: int, n: int) -> None:
                    assert mm is not None
                    with memoryview(mm) as whole, whole[i:i + n] as piece:  # released: mm can close
                        tag = self.chan.tag_out(piece)
                    if self.sock.sendfile(f, i, n) != n:
                        raise OSError(f"{path} shrank while being sent")
                    self.sock.sendall(tag)

                self._put(rel, size, value, send)
            finally:
                if mm is not None:
                    mm.close()
        return size

    def _put(self, rel: str, size: int, value: int, send: Callable[[int, int], None], extra: dict | None = None) -> None:
        """The ``put`` exchange: header (with ``extra``), ``send(offset, n)`` per piece
        (rate-limited), reply."""
        t0 = time.monotonic()
        try:
            self.chan.send({"op": "put", "path": rel, "size": size, "crc": value, **(extra or {})})
            for i in range(0, size, PIECE):
                send(i, min(PIECE, size - i))
                if self.rate > 0:
                    ahead = (i + PIECE) / self.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            reply = self.chan.recv_header()
        except (OSError, ValueError) as e:
            raise PeerError(f"peer {self.address}: put {rel} failed ({e})", self.address) from None
        if not reply.get("ok"):
            raise PeerError(f"peer {self.address}: put {rel} refused: {reply.get('error')}", self.address)

    def get(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of ``rel`` on the peer, each piece's MAC checked. :class:`SnapshotIncomplete` if it lacks it."""
        try:
            self.chan.send({"op": "get", "path": rel, "offset": offset, "length": length})
            reply = self.chan.recv_header()
            if not reply.get("ok"):
                if reply.get("missing"):
                    raise SnapshotIncomplete(f"peer {self.address}: {reply.get('error')}", f"{self.address}/{rel}")
                raise PeerError(f"peer {self.address}: get {rel} refused: {reply.get('error')}", self.address)
            return self.chan.recv_payload(int(reply["size"]))
        except PeerTampered as e:
            raise PeerError(f"peer {self.address}: {rel} damaged or tampered with in transit ({e})",
                            self.address) from None
        except (OSError, ValueError, KeyError) as e:
            raise PeerError(f"peer {self.address}: get {rel} failed ({e})", self.address) from None

    def report_holds(self, doc: dict) -> dict:
        """Send this node's holds of a version to the peer that leads its commit; its reply."""
        data = json.dumps(doc).encode()
        return self._ask({"op": "holds", "size": len(data)}, data, "holds report")

    def commit_target(self, attempt: str, after: int, wait: timedelta) -> dict:
        """Ask the peer that leads the commit which version of ``attempt`` it gathers (its reply's
        ``target``), waiting up to ``wait`` for one newer than step ``after``."""
        return self._ask({"op": "target", "attempt": attempt, "after": after, "wait": wait.total_seconds()},
                         None, "commit target query")

    def _ask(self, header: dict, payload: bytes | None, what: str) -> dict:
        try:
            self.chan.send(header, payload)
            reply = self.chan.recv_header()
        except (OSError, ValueError) as e:
            raise PeerError(f"peer {self.address}: {what} failed ({e})", self.address) from None
        if not reply.get("ok"):
            raise PeerError(f"peer {self.address}: {what} refused: {reply.get('error')}", self.address)
        return reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def peer_order(me: str, nodes: dict[str, dict], k: int) -> list[str]:
    """Deterministic replica targets for node ``me``: up to ``k`` other nodes, the next ones
    in sorted ring order whose failure domain differs from ours, then any other node."""
    ring = sorted(nodes)
    if me in ring:
        i = ring.index(me)
        ring = ring[i + 1:] + ring[:i]
    mine = nodes.get(me, {}).get("domain", me)
    other = [n for n in ring if nodes[n].get("domain", n) != mine]
    same = [n for n in ring if n not in other]
    return (other + same)[:max(0, k)]
