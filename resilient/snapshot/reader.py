"""Streaming reads of durable versions, for restore and the checkpoint tools.

Nothing here loads a whole model: a reader lists versions, opens a manifest
(JSON, checked field by field), and reads any region of any tensor by
fetching only the byte ranges of the chunks that overlap it. Every chunk is
checked against its checksum before its bytes are used.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import torch
from fsspec.implementations.local import LocalFileSystem

from resilient.snapshot.api import (
    ChunkRecord, Manifest, NoSnapshotFound, SnapshotCorrupt, SnapshotError, SnapshotIncomplete, SnapshotMismatch,
    TensorRecord,
)
from resilient.snapshot.auth import SIGN_HINT, SnapshotUnsigned, SnapshotUnauthentic, VersionAuth, check_chunk
from resilient.snapshot.boxes import Box, copy_overlap
from resilient.snapshot.format import (
    MANIFEST_NAME, decompress, dtype_from_name, inflate_pieces, manifest_from_json, verify, version_dir,
)
from resilient.snapshot.retention import list_versions
from resilient.snapshot.storage import RetryPolicy, open_url, read_range, read_range_into, with_retry


@dataclass(frozen=True)
class VersionInfo:
    step: int
    path: str
    complete: bool


class SnapshotReader:
    """Read-only access to the versions under an fsspec URL.

    ``secret`` (the job secret): every manifest's MAC is checked before it is parsed and
    every chunk's before its bytes are used (:mod:`.auth`); a version without MACs is
    refused (:class:`~.auth.SnapshotUnsigned`). Without it, only the CRCs are checked."""

    def __init__(self, url: str, storage_options: dict | None = None, retry: RetryPolicy = RetryPolicy(),
                 threads: int = 8, secret=None):
        self.url = url
        self.fs, self.root = open_url(url, storage_options)
        self.retry = retry
        self.threads = threads
        self.auth = secret if isinstance(secret, VersionAuth) or secret is None else VersionAuth(secret)

    def versions(self) -> list[VersionInfo]:
        """Every version directory, oldest first; ``complete`` = its manifest exists."""
        found = with_retry(lambda: list_versions(self.fs, self.root), self.url, self.retry)
        return [VersionInfo(s, p, ok) for s, (p, ok) in sorted(found.items())]

    def complete_steps(self) -> list[int]:
        return [v.step for v in self.versions() if v.complete]

    def manifest_path(self, step: int) -> str:
        return f"{self.root}/{version_dir(step)}/{MANIFEST_NAME}"

    def manifest(self, step: int | None = None) -> Manifest:
        """The manifest of ``step`` (default: the newest complete version)."""
        if step is None:
            steps = self.complete_steps()
            if not steps:
                raise NoSnapshotFound(f"{self.url}: no complete snapshot version; nothing to restore", self.url)
            step = steps[-1]
        path = self.manifest_path(step)
        try:
            data = with_retry(lambda: self.fs.cat_file(path), path, self.retry)
        except FileNotFoundError:
            raise SnapshotIncomplete(f"{path}: no manifest; step {step} is not a complete version", path) from None
        m = manifest_from_json(self.auth.open_manifest(data, path) if self.auth is not None else data, path)
        if m.step != step:
            raise SnapshotCorrupt(f"{path}: manifest says step {m.step}, its directory says {step}", path)
        return m

    def tensors(self, manifest: Manifest) -> Iterator[TensorRecord]:
        return iter(manifest.tensors.values())

    def object_path(self, manifest: Manifest, chunk: ChunkRecord) -> str:
        return f"{self.root}/{version_dir(manifest.step)}/{chunk.object}"

    def read_chunk(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord) -> torch.Tensor:
        """One chunk as a CPU tensor of shape ``chunk.sizes``, verified."""
        path = self.object_path(manifest, chunk)
        where = f"{path}@{chunk.offset}+{chunk.length} ({tensor.name})"
        data = self._verified(lambda: read_range(self.fs, path, chunk.offset, chunk.offset + chunk.length),
                              path, manifest.step, chunk, where)
        return decode_chunk(data, tensor, chunk, where)

    def _verified(self, read, path: str, step: int, chunk: ChunkRecord, where: str, inflate: bool = True):
        """``read()`` (with storage retries) until its bytes check out (:func:`open_chunk`): a bit
        flipped in transit reads right the second time; one on disk doesn't (raises). Returns
        the raw (decompressed) bytes; without ``inflate``, a compressed chunk's stored bytes
        once their CRC matched (its MAC is the caller's to check)."""
        for attempt in (1, 2):
            data = with_retry(read, path, self.retry)
            try:
                if not inflate and chunk.compression != "none":
                    verify(data, chunk.checksum, where)
                    return data
                return open_chunk(self.auth, step, chunk, data, where)
            except SnapshotCorrupt:
                if attempt == 2:
                    raise

    def before_read(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord) -> None:
        """A hook before a chunk's range is read (the tools check it against the object's size)."""

    def check_chunk(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord) -> None:
        """What :meth:`read_chunk` checks, without keeping the chunk: a compressed one is inflated a
        piece at a time (bounded memory whatever its manifest claims: ``ckpt verify``)."""
        if chunk.compression == "none":
            self.read_chunk(manifest, tensor, chunk)
            return
        self.before_read(manifest, tensor, chunk)
        path = self.object_path(manifest, chunk)
        where = f"{path}@{chunk.offset}+{chunk.length} ({tensor.name})"
        stored = self._verified(lambda: read_range(self.fs, path, chunk.offset, chunk.offset + chunk.length),
                                path, manifest.step, chunk, where, inflate=False)
        pieces = inflate_pieces(stored, chunk.raw_length, where)
        if self.auth is not None and not chunk.mac:
            raise SnapshotUnsigned(f"{where}: the chunk carries no MAC; {SIGN_HINT}", where)
        if self.auth is None:
            for _ in pieces:
                pass
        elif not self.auth.chunk_ok_pieces(manifest.step, chunk, pieces):
            raise SnapshotUnauthentic(f"{where}: the chunk's bytes do not match its MAC (its CRC does): forged, "
                                      "not damaged", where)

    def read_into(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord, out: torch.Tensor) -> bool:
        """Read an uncompressed chunk of a local file straight into ``out`` (contiguous, the
        chunk's shape and dtype) and verify it there: one copy fewer than :meth:`read_chunk`.
        Returns False when this reader cannot (remote storage, compressed chunk); the caller
        then uses :meth:`read_chunk`. On a bad checksum ``out`` holds garbage and this raises."""
        view = chunk_view(chunk, out)
        if view is None or not isinstance(self.fs, LocalFileSystem):
            return False
        path = self.object_path(manifest, chunk)
        where = f"{path}@{chunk.offset}+{chunk.length} ({tensor.name})"

        def read() -> memoryview:
            read_range_into(self.fs, path, chunk.offset, view)
            return view

        self._verified(read, path, manifest.step, chunk, where)
        return True

    def verify(self, manifest: Manifest) -> list[SnapshotError]:
        """Check a whole version, streaming: every chunk's bytes against its checksum and
        every tensor tiled exactly. Returns the problems found (empty: the version is sound)."""
        problems: list[SnapshotError] = []
        for t in manifest.tensors.values():
            covered = sum(Box(c.offsets, c.sizes).numel for c in t.chunks)
            if covered != t.numel:
                problems.append(SnapshotIncomplete(
                    f"{self.url} step {manifest.step}: {t.name!r} has {covered} of {t.numel} elements", self.url))
        work = [(t, c) for t in manifest.tensors.values() for c in t.chunks]

        def check(tc: tuple[TensorRecord, ChunkRecord]) -> SnapshotError | None:
            try:
                self.read_chunk(manifest, *tc)
            except SnapshotError as e:
                return e
            return None

        with ThreadPoolExecutor(max(1, self.threads)) as pool:
            problems += [e for e in pool.map(check, work) if e is not None]
        return problems

    def read_region(self, manifest: Manifest, name: str, box: Box | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``box`` (default: all) of tensor ``name``, fetched chunk by overlapping chunk."""
        t = manifest.tensors.get(name)
        if t is None:
            raise SnapshotMismatch(f"{self.url} step {manifest.step}: no tensor {name!r}", self.url)
        whole = box is None
        box = box or Box((0,) * len(t.shape), t.shape)
        if out is None:
            # A hostile or garbled manifest may claim any shape: before allocating for it, a reader
            # that can (the tools' CheckedReader) checks every stored byte its chunks claim exists;
            # what is still more than this host holds is a typed error, not an allocator's.
            check = getattr(self, "before_read", None)
            if whole and check is not None:
                for c in t.chunks:
                    check(manifest, t, c)
            dtype = dtype_from_name(t.dtype, name)
            try:
                out = torch.empty(box.sizes, dtype=dtype)
            except (RuntimeError, MemoryError):
                raise SnapshotError(
                    f"{self.url} step {manifest.step}: {name!r} claims {list(box.sizes)} {t.dtype} "
                    f"({box.numel * dtype.itemsize} bytes), more than this host can allocate; if the checkpoint "
                    "is sound, run this on a host with more memory (or convert to safetensors/DCP, which "
                    "stream)", self.url) from None
        fill_boxes(self, manifest, t, [(box, out)])
        return out


def chunk_view(chunk: ChunkRecord, out: torch.Tensor) -> memoryview | None:
    """``out``'s bytes, writable, when ``chunk`` can be read straight into it (a ``read_into``):
    stored uncompressed, and ``out`` a contiguous host tensor of exactly its size; else None."""
    if (chunk.compression != "none" or out.device.type != "cpu" or not out.is_contiguous()
            or out.numel() * out.element_size() != chunk.length):
        return None
    return memoryview(out.reshape(-1).view(torch.uint8).numpy()) if chunk.length else memoryview(bytearray())


def open_chunk(auth: VersionAuth | None, step: int, chunk: ChunkRecord, stored, where: str):
    """A chunk's stored bytes checked (CRC, and its MAC when ``auth``: :func:`~.auth.check_chunk`)
    and decompressed (bounded by its ``raw_length``): its raw bytes, safe to use."""
    return check_chunk(auth, step, chunk, stored, where, lambda b: decompress(b, chunk.raw_length, where))


def decode_chunk(data: bytes, tensor: TensorRecord, chunk: ChunkRecord, where: str) -> torch.Tensor:
    """Checked raw bytes of ``chunk`` (:func:`open_chunk`) → a CPU tensor of shape ``chunk.sizes``."""
    if len(data) != chunk.raw_length:
        raise SnapshotCorrupt(f"{where}: {len(data)} bytes, expected {chunk.raw_length}", where)
    dtype = dtype_from_name(tensor.dtype, where)
    n = 1
    for s in chunk.sizes:
        n *= s
    if n * torch.empty((), dtype=dtype).element_size() != len(data):
        raise SnapshotCorrupt(f"{where}: {len(data)} bytes do not hold {list(chunk.sizes)} x {tensor.dtype}", where)
    if n == 0:
        return torch.empty(chunk.sizes, dtype=dtype)
    with warnings.catch_warnings():  # read-only bytes are fine: the tensor is only copied from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype).view(chunk.sizes)


def fill_boxes(reader: SnapshotReader, manifest: Manifest, t: TensorRecord,
               wanted: list[tuple[Box, torch.Tensor]]) -> int:
    """Copy every stored chunk overlapping each wanted box into its tensor; returns bytes read."""
    return fill_many(reader, manifest, [(t, wanted)])


def fill_many(reader: SnapshotReader, manifest: Manifest,
              jobs: list[tuple[TensorRecord, list[tuple[Box, torch.Tensor]]]]) -> int:
    """:func:`fill_boxes` for many tensors at once, chunks fetched in parallel.

    Each worker thread reads a chunk and copies it into its destinations itself
    (chunks never overlap, so the copies touch disjoint regions). A chunk that
    lies inside one wanted box whose rows are contiguous (the same layout, or
    dp-only resharding along rows) is read straight into its destination, for a
    reader with ``read_into``; any other uncompressed chunk is read into the
    thread's reusable scratch buffer and copied out of it, instead of into a
    fresh bytes object per chunk (whose pages the kernel zero-fills: on a
    resharded restore that doubled the time). So memory beyond the destinations
    stays at one chunk per thread. Raises :class:`SnapshotIncomplete` when the
    chunks do not cover a wanted box, :class:`SnapshotCorrupt` on a bad chunk."""
    work = [(j, c) for j, (t, wanted) in enumerate(jobs) for c in t.chunks
            if any(Box(c.offsets, c.sizes).intersect(b) for b, _ in wanted)]
    covered = [[0] * len(wanted) for _, wanted in jobs]
    lock = threading.Lock()
    direct_read = getattr(reader, "read_into", None)
    scratch = threading.local()

    def scratch_for(tensor: TensorRecord, c: ChunkRecord) -> torch.Tensor | None:
        """This thread's buffer viewed as the chunk (None if the record's sizes disagree)."""
        dtype = dtype_from_name(tensor.dtype, tensor.name)
        if math.prod(c.sizes) * dtype.itemsize != c.length:
            return None
        buf = getattr(scratch, "buf", None)
        if buf is None or buf.numel() < c.length:
            buf = scratch.buf = torch.empty(c.length, dtype=torch.uint8)
        return buf[:c.length].view(dtype).view(c.sizes)

    def fetch(j: int, c: ChunkRecord) -> torch.Tensor | None:
        """The chunk's data, or None when it was read straight into its destination."""
        tensor = jobs[j][0]
        if direct_read is not None:
            cbox = Box(c.offsets, c.sizes)
            for b, dst in jobs[j][1]:
                if cbox.intersect(b) == cbox:
                    out = dst[cbox.slices_within(b)]
                    if out.is_contiguous() and direct_read(manifest, tensor, c, out):
                        return None
                    break
            out = scratch_for(tensor, c) if c.compression == "none" and c.length else None
            if out is not None and direct_read(manifest, tensor, c, out):
                return out
        return reader.read_chunk(manifest, tensor, c)

    def fetch_and_place(j: int, c: ChunkRecord) -> None:
        data = fetch(j, c)
        cbox = Box(c.offsets, c.sizes)
        for i, (b, dst) in enumerate(jobs[j][1]):
            if data is None:  # read straight into this destination
                n = cbox.numel if cbox.intersect(b) == cbox else 0
            else:
                n = copy_overlap(cbox, data, b, dst)
            if n:
                with lock:
                    covered[j][i] += n

    window = max(1, 2 * reader.threads)
    with ThreadPoolExecutor(max(1, min(reader.threads, len(work) or 1))) as pool:
        inflight: deque = deque()
        try:
            for j, c in work:
                inflight.append(pool.submit(fetch_and_place, j, c))
                if len(inflight) >= window:
                    inflight.popleft().result()
            while inflight:
                inflight.popleft().result()
        finally:   # on an error, drop the chunks not started yet (the pool waits for the rest)
            for f in inflight:
                f.cancel()
    for (t, wanted), cov in zip(jobs, covered):
        for (b, _), n in zip(wanted, cov):
            if n != b.numel:
                raise SnapshotIncomplete(
                    f"{reader.url} step {manifest.step}: {t.name!r} region {list(b.offsets)}+{list(b.sizes)} has "
                    f"only {n} of {b.numel} elements stored; the version is incomplete", reader.url)
    return sum(c.length for _, c in work)
