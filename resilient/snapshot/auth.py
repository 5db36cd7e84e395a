"""Authenticated versions: a MAC over every manifest, a MAC over every chunk's bytes.

Why both, and why not the CRC: a CRC finds accidents, not forgeries. Whoever can
write a manifest can recompute a CRC-32C (it is linear: four free bytes forge any
value), and a poisoned node-store chunk with its CRC recomputed was restored. So,
under a key derived from the job secret (:mod:`resilient.secret`, which never passes
through etcd, a peer or storage):

* every chunk carries ``"mac": "gmac:<nonce><tag>"``: AES-128-GMAC of its *raw*
  (uncompressed) bytes under a key per version (HMAC of the chunk purpose's key over
  the step and the chunk's attempt directory) and a random 96-bit nonce. Raw bytes,
  so one tag serves every tier (the node store writes raw, the durable tier may
  compress): it is computed once per capture and carried by the node store, the peer
  push and the durable upload (:class:`~resilient.snapshot.capture.Slot`). Random
  nonces under per-version keys: a few thousand tags per key, far below GCM's 2^32.
* every manifest ends with ``"mac": "hmac-sha256:<hex>"``, an HMAC over its own bytes
  before that field: everything a restore trusts (the chunk list, objects, offsets,
  sizes, checksums and chunk tags, step, world, layout, config digest, extras). It is
  checked before the manifest is parsed, and a restore reads no chunk of a version
  whose manifest fails.

GMAC runs near memory speed through ``cryptography`` (OpenSSL's AES-NI/PCLMUL code;
measured here on 64 MiB: 10-15 GB/s, HMAC-SHA256 0.8, keyed BLAKE3 6.9, CRC-32C 14),
so a restore that holds the secret checks the tag *instead of* the CRC (one pass per
byte) and looks at the CRC only to tell an accident (:class:`SnapshotCorrupt`, retried
and reported as damage) from a forgery (:class:`SnapshotUnauthentic`, an
``auth_failure``). Without a secret (``ckpt verify`` without ``--secret-file``, a
library user who gave none) only the CRCs are checked: integrity, not authenticity.

A reader holding a secret refuses a version without MACs (:class:`SnapshotUnsigned`:
written before this change, or without a secret); ``resilient ckpt sign`` adopts one
the operator trusts (docs/format.md).
"""

from __future__ import annotations

import hmac
import os
import re
from collections import OrderedDict
from typing import Any

from resilient.secret import JobSecret, Unauthentic
from resilient.snapshot.api import ChunkRecord, SnapshotError
from resilient.snapshot.format import verify

MANIFEST_PURPOSE = "snapshot-manifest"
CHUNK_PURPOSE = "snapshot-chunk"
CHUNK_MAC = "gmac:"
NONCE = 12
TAG = 16
# The most one AESGCM call of ``cryptography`` authenticates (its C API takes an int); a
# chunk is cut at snapshot.chunk_mib (at most 1 GiB), larger only when one row of its tensor is.
ONE_CALL = (1 << 31) - 1
_MANIFEST_MAC = re.compile(rb',"mac":"hmac-sha256:([0-9a-f]{64})"\}\s*\Z')
_CHUNK_MAC = re.compile(r"gmac:([0-9a-f]{24})([0-9a-f]{32})")
SIGN_HINT = ("if you trust it (your own checkpoint from before authenticated versions), adopt it with "
             "`resilient ckpt sign URL@STEP --secret-file FILE`; otherwise delete it")


class SnapshotUnauthentic(SnapshotError, Unauthentic):
    """A manifest or chunk does not carry a valid MAC under this job's secret: forged, tampered
    with, or written by a job with another secret. Never loaded; restore goes on to the next
    candidate version or tier. Find who can write that storage (or node store)."""


class SnapshotUnsigned(SnapshotUnauthentic):
    """A version carries no MACs (written before authenticated versions, or without a job
    secret): a reader that holds the secret cannot tell it from a forgery, so it is not loaded."""


class SnapshotAbandoned(SnapshotUnauthentic):
    """A genuine version (its MACs verify) of a step that a rollback abandoned: made in an epoch
    before a rollback that kept only older steps (:mod:`resilient.snapshot.epoch`). It was deleted
    at the rollback, so it is here only because it was put back (storage access, or a node store
    kept across the rollback): never loaded, as it may hold the corruption rolled back from."""


def admit(epoch: Any, m: Any, where: str) -> None:
    """Raise :class:`SnapshotAbandoned` unless ``epoch`` (the run's :class:`~.epoch.Epoch`, None:
    unknown) admits version ``m``: its step, and the epoch its rank 0 stamped in it."""
    if epoch is not None and not epoch.admits(m.step, m.epoch):
        raise SnapshotAbandoned(
            f"{where}: step {m.step} (written in epoch {m.epoch}) belongs to a future that a rollback to step "
            f"{epoch.cap(m.epoch)} abandoned (the run is in epoch {epoch.gen}); it was put back after that "
            "rollback deleted it, and is not loaded", where)


def _slices(raw: Any, size: int = 1 << 30):
    """``raw``'s bytes as views of at most ``size`` bytes (one GMAC call takes under 2 GiB)."""
    view = memoryview(raw).cast("B")
    return (view[i:i + size] for i in range(0, len(view), size))


def attempt_of(obj: str) -> str:
    """The attempt directory a chunk's object lives in (its first path component)."""
    return obj.split("/", 1)[0]


class VersionAuth:
    """The job secret's snapshot keys: sign and check manifests and chunk tags."""

    def __init__(self, secret: JobSecret | bytes):
        self.secret = JobSecret.of(secret)
        self._keys: OrderedDict[tuple[int, str], Any] = OrderedDict()

    @property
    def fingerprint(self) -> str:
        return self.secret.fingerprint

    # -- chunks -----------------------------------------------------------------
    def _gmac(self, step: int, attempt: str):
        """AESGCM under the version's chunk key (kept for the few versions in use)."""
        key = (step, attempt)
        aes = self._keys.get(key)
        if aes is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            aes = AESGCM(self.secret.mac(CHUNK_PURPOSE, b"%d" % step, attempt.encode())[:16])
            self._keys[key] = aes
            while len(self._keys) > 64:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        return aes

    def chunk_mac(self, step: int, attempt: str, raw: Any, nonce: bytes | None = None) -> str:
        """The ``mac`` field of a chunk whose raw bytes are ``raw`` in version (``step``, ``attempt``)."""
        nonce = os.urandom(NONCE) if nonce is None else nonce
        if memoryview(raw).nbytes > ONE_CALL:   # one row above 2 GiB: more than one call takes
            return self.chunk_mac_pieces(step, attempt, _slices(raw), nonce)
        return CHUNK_MAC + nonce.hex() + self._gmac(step, attempt).encrypt(nonce, b"", raw).hex()

    def chunk_ok(self, step: int, chunk: ChunkRecord, raw: Any) -> bool:
        m = _CHUNK_MAC.fullmatch(chunk.mac or "")
        if m is None:
            return False
        if memoryview(raw).nbytes > ONE_CALL:
            return self.chunk_ok_pieces(step, chunk, _slices(raw))
        nonce, tag = bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2))
        got = self._gmac(step, attempt_of(chunk.object)).encrypt(nonce, b"", raw)
        return hmac.compare_digest(got, tag)

    def gmac_stream(self, step: int, attempt: str, nonce: bytes) -> Any:
        """A chunk's GMAC over bytes that come in pieces, under the version's chunk key:
        ``authenticate_additional_data`` each piece, then ``finalize()``; its ``tag``."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        key = self.secret.mac(CHUNK_PURPOSE, b"%d" % step, attempt.encode())[:16]
        return Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()

    def chunk_mac_pieces(self, step: int, attempt: str, pieces, nonce: bytes | None = None) -> str:
        """:meth:`chunk_mac` over raw bytes that come in pieces (a compressed chunk inflated a
        bounded piece at a time: ``ckpt verify`` and ``ckpt sign`` never hold a whole chunk)."""
        nonce = os.urandom(NONCE) if nonce is None else nonce
        gmac = self.gmac_stream(step, attempt, nonce)
        for p in pieces:
            gmac.authenticate_additional_data(p)
        gmac.finalize()
        return CHUNK_MAC + nonce.hex() + gmac.tag.hex()

    def chunk_ok_pieces(self, step: int, chunk: ChunkRecord, pieces) -> bool:
        m = _CHUNK_MAC.fullmatch(chunk.mac or "")
        nonce = bytes.fromhex(m.group(1)) if m is not None else bytes(NONCE)
        got = self.chunk_mac_pieces(step, attempt_of(chunk.object), pieces, nonce)  # inflated in full either way
        return m is not None and hmac.compare_digest(got, chunk.mac)

    # -- manifests --------------------------------------------------------------
    def _manifest_mac(self, body: bytes) -> str:
        return self.secret.mac(MANIFEST_PURPOSE, body).hex()

    def sign_manifest(self, body: bytes) -> bytes:
        """``body`` (a JSON object's bytes, as :func:`~.format.manifest_to_json` writes it) with
        its MAC as the last field; still a JSON object any tool can read."""
        body = bytes(body).rstrip()
        if not body.endswith(b"}"):
            raise ValueError("a manifest body is a JSON object")
        sep = b"," if body[:-1].rstrip() != b"{" else b""
        return body[:-1] + sep + b'"mac":"hmac-sha256:' + self._manifest_mac(body).encode() + b'"}'

    def open_manifest(self, data: bytes, where: str) -> bytes:
        """The body of a signed manifest whose MAC verifies (what :meth:`sign_manifest` signed);
        :class:`SnapshotUnsigned` / :class:`SnapshotUnauthentic` otherwise."""
        data = bytes(data)
        m = _MANIFEST_MAC.search(data)
        if m is None:
            raise SnapshotUnsigned(f"{where}: the manifest carries no MAC, so this job cannot tell it from a "
                                   f"forgery; {SIGN_HINT}", where)
        body = data[:m.start()] + b"}"
        if not hmac.compare_digest(m.group(1).decode(), self._manifest_mac(body)):
            raise SnapshotUnauthentic(
                f"{where}: the manifest's MAC does not verify under this job's secret (fingerprint "
                f"{self.fingerprint}): forged or tampered with, or written by a job with another secret; it is "
                "not loaded", where)
        return body


def object_macs(tiled: dict[str, list[tuple[int, int, str, Any]]]) -> dict[str, list[list]]:
    """``{object: [[offset, length, mac], ...]}`` of the objects in ``tiled``
    (:func:`~resilient.snapshot.format.tiled_chunks`) whose every chunk carries a chunk MAC:
    what a push hands the peer to check the part's bytes against (:class:`ChunkStream`)."""
    return {obj: [[o, n, mac] for o, n, _, mac in chunks] for obj, chunks in tiled.items()
            if chunks and all(isinstance(mac, str) and _CHUNK_MAC.fullmatch(mac) for *_, mac in chunks)}


class ChunkStream:
    """Checks an object's bytes against its chunks' MACs as the bytes arrive, in order, a piece
    at a time (each piece checked while it is in the cache): a peer receiving a replica
    (:mod:`~resilient.snapshot.peer`) checks the tags its rank computed at capture instead of
    the sender tagging every piece again, so the bytes are authenticated end to end, from the
    capture to the store that keeps them, in one pass on the receiving side and none on the
    sending side. ``chunks``: ``[[offset, length, "gmac:..."], ...]`` tiling ``[0, size)``
    (:func:`object_macs`); ``step``/``attempt``: the version the receiver stores the object in,
    whose key the tags must verify under (bytes of another version, or another attempt, fail).
    A malformed list is a ``ValueError`` at once; :meth:`ok` after the last byte says whether
    every chunk verified."""

    def __init__(self, auth: VersionAuth, step: int, attempt: str, chunks: Any, size: int):
        if not isinstance(chunks, list):
            raise ValueError("chunk MACs: not a list")
        parsed, end = [], 0
        for c in chunks:
            if not (isinstance(c, list) and len(c) == 3 and type(c[0]) is int and type(c[1]) is int
                    and c[0] == end and c[1] >= 0 and isinstance(c[2], str)):
                raise ValueError(f"chunk MACs: {c!r} does not follow byte {end}")
            m = _CHUNK_MAC.fullmatch(c[2])
            if m is None:
                raise ValueError(f"chunk MACs: {c[2]!r} is not a chunk MAC")
            parsed.append((c[0], c[1], bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2))))
            end += c[1]
        if end != size:
            raise ValueError(f"chunk MACs cover {end} bytes of {size}")
        self._auth, self._step, self._attempt = auth, step, attempt
        self._aes = auth._gmac(step, attempt)
        self._chunks, self._i, self._ctx, self.bad = parsed, 0, None, None
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._i < len(self._chunks) and self._chunks[self._i][1] == 0:
            self._verify(self._aes.encrypt(self._chunks[self._i][2], b"", b""))

    def _verify(self, got: bytes) -> None:
        offset, _, _, tag = self._chunks[self._i]
        if self.bad is None and not hmac.compare_digest(got, tag):
            self.bad = offset
        self._i += 1

    def feed(self, offset: int, view: Any) -> None:
        """The object's bytes at ``offset``, the next ones after the last fed."""
        pos, end = offset, offset + len(view)
        while pos < end and self._i < len(self._chunks):
            start, length, nonce, _ = self._chunks[self._i]
            stop = start + length
            a, b = pos - offset, min(end, stop) - offset
            if self._ctx is None and pos == start and stop <= end:
                self._verify(self._aes.encrypt(nonce, b"", view[a:b]))   # the whole chunk: one call
            else:   # a chunk across pieces: GMAC fed as it comes
                if self._ctx is None:
                    self._ctx = self._auth.gmac_stream(self._step, self._attempt, nonce)
                self._ctx.authenticate_additional_data(view[a:b])
                if offset + b == stop:
                    self._ctx.finalize()
                    tag, self._ctx = self._ctx.tag, None
                    self._verify(tag)
            pos = offset + b
            self._skip_empty()

    def ok(self) -> bool:
        """Every chunk fed and verified."""
        return self.bad is None and self._i == len(self._chunks) and self._ctx is None


def check_chunk(auth: VersionAuth | None, step: int, chunk: ChunkRecord, stored: Any, where: str,
                raw_of=None) -> Any:
    """Check a chunk's stored bytes before anything uses them; returns its raw bytes.

    Without ``auth``: the CRC of the stored bytes (integrity). With it: the chunk's GMAC
    over its raw bytes (one pass, instead of the CRC); on a mismatch the CRC tells damage
    (:class:`SnapshotCorrupt`) from forgery (:class:`SnapshotUnauthentic`). ``raw_of(stored)``
    decompresses a compressed chunk (bounded by its ``raw_length``); it runs only after the
    stored bytes' CRC matched."""
    compressed = chunk.compression != "none"
    if auth is None or compressed:
        verify(stored, chunk.checksum, where)
    raw = raw_of(stored) if compressed else stored
    if auth is None:
        return raw
    if not chunk.mac:
        raise SnapshotUnsigned(f"{where}: the chunk carries no MAC; {SIGN_HINT}", where)
    if auth.chunk_ok(step, chunk, raw):
        return raw
    if not compressed:
        verify(stored, chunk.checksum, where)  # SnapshotCorrupt when it is damage, not forgery
    raise SnapshotUnauthentic(f"{where}: the chunk's bytes do not match its MAC (its CRC does): forged, not "
                              "damaged; it is not loaded", where)


def report(events: Any, error: SnapshotError) -> None:
    """An ``auth_failure`` event (and a warning) for a version or chunk that failed its MAC."""
    if isinstance(error, SnapshotUnauthentic):
        from resilient.secret import report_unauthentic

        key = error.obj or ""
        what = "abandoned snapshot version" if isinstance(error, SnapshotAbandoned) else "snapshot"
        report_unauthentic(events, what, key, str(error).removeprefix(f"{key}: "))


__all__ = ["VersionAuth", "SnapshotUnauthentic", "SnapshotUnsigned", "SnapshotAbandoned", "admit", "check_chunk",
           "report"]
