"""The durable tier: a background uploader per rank and a committer on rank 0.

How a multi-rank version becomes complete, atomically, without the training
loop ever waiting on storage or on another rank:

1. Each rank's uploader thread writes its chunks as *parts* (objects of
   ~``part_bytes``, several in parallel) under
   ``step-S/ATTEMPT/rRRRRR-pPPPP.bin``, then its *rank manifest*
   ``step-S/ATTEMPT/rRRRRR.json`` (chunk records + checksums + its extras).
   A rank manifest exists only after all its parts were written and their
   sizes checked, so its presence means the rank is done.
2. Rank 0's committer thread polls for the rank manifests of each pending
   version (one ``ls`` per poll, backing off), and when all ``world`` of them
   are there, merges them, checks every tensor is tiled exactly, and writes
   ``step-S/manifest.json`` last (atomically, read back and compared). Only a
   version with that manifest is complete; readers look at nothing else.

ATTEMPT is ``TOKEN-SEQ``: a token rank 0 draws once per Snapshotter and shares
with the other ranks at the first save, and the capture's sequence number
(the same on every rank, since all ranks capture at the same steps). So debris
of an earlier job attempt at the same step (another world size, a crash), or
of the same step saved again after a rollback, is never mixed into a version.

Parts rather than one object per rank: parallel PUTs and per-part retries
(a failure re-sends 64 MiB, not a rank's whole shard). Parts rather than one
object per chunk: thousands of tiny PUTs would cost more in requests than in
bytes, and S3 multipart parts must be >= 5 MiB anyway.

Coalescing: if a rank's uploads fall behind, its ring slot is overwritten by
the next capture and that version is skipped on that rank. A version some
rank skipped never completes; the committer drops it once a newer version
commits (or after ``commit_timeout``), and retention removes its debris.
A failed upload is an ``upload_error`` event and a warning, never an
exception in the training loop.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from resilient.events import emit
from resilient.snapshot.api import ChunkRecord, Manifest, SnapshotError, TensorRecord
from resilient.snapshot.capture import Slot, SlotRing, chunk_views
from resilient.snapshot.auth import VersionAuth, report as report_auth
from resilient.snapshot.format import (
    MANIFEST_NAME, MAX_INFLATE, checksum, compress, crc, dtype_name, manifest_from_json, manifest_to_json,
    merge_rank_manifests, should_compress, version_dir,
)
from resilient.snapshot.priority import UPLOAD_NICE, background_priority
from resilient.snapshot.retention import collect_garbage
from resilient.snapshot.sinks import open_sink
from resilient.snapshot.storage import RetryPolicy, with_retry, write_object


@dataclass
class DurableOptions:
    """How the durable tier writes; see :class:`resilient.snapshot.config.SnapshotConfig`."""

    threads: int = 4
    compress: str = "auto"
    keep_last: int = 3
    keep_every: int = 0
    part_bytes: int = 64 << 20
    chunk_bytes: int = 16 << 20
    commit_timeout: timedelta = timedelta(minutes=30)
    retry: RetryPolicy = RetryPolicy()


def _background_priority() -> None:
    background_priority(UPLOAD_NICE)


def rank_manifest_name(attempt: str, rank: int) -> str:
    return f"{attempt}/r{rank:05d}.json"


class Uploader:
    """One rank's background writer: takes captured slots and streams them to storage."""

    def __init__(self, fs, root: str, rank: int, world: int, ring: SlotRing, opts: DurableOptions,
                 events: Any, layout: dict, config_digest: str, committer: "Committer | None",
                 consumer: str = "durable", auth: VersionAuth | None = None):
        self.fs, self.root, self.rank, self.world = fs, root, rank, world
        self.auth = auth  # signs the rank manifests and tags each chunk (None: unsigned, CRCs only)
        self.consumer = consumer  # its name in the (possibly shared) ring
        self.ring, self.opts, self.events = ring, opts, events
        self.layout, self.config_digest, self.committer = layout, config_digest, committer
        self.attempt = ""
        self.epoch = 0   # the run's rollback epoch, stamped in each rank manifest (Snapshotter.epoch)
        self.sink = open_sink(fs, root)  # the durable tier's storage, or an agent's node store
        self.last_uploaded: int | None = None
        self.failures = 0
        self.errors: dict[int, str] = {}  # step → why its upload failed (the newest few)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max(1, opts.threads), thread_name_prefix="snapshot-upload",
                                        initializer=_background_priority)
        self._thread = threading.Thread(target=self._run, name=f"snapshot-uploader-r{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _background_priority()
        while True:
            slot = self.ring.take(self.consumer, timedelta(milliseconds=200))
            if slot is None:
                if self._stop.is_set():
                    return
                continue
            try:
                self._upload(slot)
            except Exception as e:  # a failed upload must never reach training
                self.failures += 1
                self.errors[slot.step] = f"{type(e).__name__}: {e}"
                for old in sorted(self.errors)[:-8]:
                    del self.errors[old]
                emit(self.events, "upload_error", step=slot.step, phase="upload",
                     error=f"{type(e).__name__}: {e}", obj=getattr(e, "obj", None))
                if not self.sink.failed(slot.step, e):  # a full node store is reported to its agent instead
                    warnings.warn(f"snapshot upload of step {slot.step} failed, training goes on: {e}", RuntimeWarning)
            finally:
                self.ring.release(slot, self.consumer)

    def _write_part(self, vdir: str, obj: str, slot: Slot, idxs: list[int], views: list[memoryview],
                    retries: list[int]) -> list[tuple[str, ChunkRecord]]:
        """Write one part; each chunk is checksummed (and compressed) just before it is
        written, so checksumming overlaps the kernel's writeback of earlier chunks."""
        records: list[tuple[str, ChunkRecord]] = []
        adir = obj.split("/", 1)[0]
        fp = self.auth.fingerprint if self.auth is not None else ""

        def seal(raw: memoryview) -> tuple[int, str]:
            # The capture's two passes over each chunk, once for every tier (Slot.seals):
            # its CRC-32C (integrity, checked without the secret) and its GMAC (authenticity).
            return crc(raw), (self.auth.chunk_mac(slot.step, adir, raw) if self.auth is not None else "")

        def payloads():
            records.clear()
            offset = 0
            for i in idxs:
                c = slot.plan.chunks[i]
                data, how = views[i], "none"
                raw_crc, mac = slot.seals.get((i, fp), lambda: seal(views[i]))
                check = f"crc32c:{raw_crc:08x}"
                # a chunk above what a reader inflates (one row > MAX_INFLATE) is stored raw
                if should_compress(self.opts.compress, c.dtype, self.sink.remote) and c.nbytes <= MAX_INFLATE:
                    packed = compress(data)
                    if len(packed) < 0.97 * len(data):  # only where it pays
                        data, how, check = packed, "zstd", checksum(packed)
                records.append((c.name, ChunkRecord(obj, offset, len(data), c.nbytes, c.box.offsets,
                                                    c.box.sizes, check, how, mac)))
                offset += len(data)
                yield data

        def bump(attempt: int, err: BaseException) -> None:
            retries[0] += 1
            emit(self.events, "upload_error", step=slot.step, phase="part", obj=f"{vdir}/{obj}",
                 attempt=attempt, error=f"{type(err).__name__}: {err}", retrying=True)

        chunks = [slot.plan.chunks[i] for i in idxs]
        # Known beforehand unless a chunk may be compressed (a node store then maps the file).
        size = (sum(c.nbytes for c in chunks)
                if not any(should_compress(self.opts.compress, c.dtype, self.sink.remote) and c.nbytes <= MAX_INFLATE
                           for c in chunks)
                else lambda: sum(r.length for _, r in records))
        with_retry(lambda: self.sink.write(f"{vdir}/{obj}", payloads(), size),
                   f"{vdir}/{obj}", self.opts.retry, bump)
        return records

    def _upload(self, slot: Slot) -> None:
        slot.wait_copied()
        t0 = time.monotonic()
        vdir = f"{self.root}/{version_dir(slot.step)}"
        views = chunk_views(slot)
        retries = [0]
        adir = f"{self.attempt}-{slot.seq:06d}"
        futures = [self._pool.submit(self._write_part, vdir, f"{adir}/r{self.rank:05d}-p{p:04d}.bin",
                                     slot, idxs, views, retries)
                   for p, idxs in enumerate(slot.plan.parts)]
        tensors = {tp.name: TensorRecord(tp.name, tp.shape, dtype_name(tp.dtype)) for tp in slot.plan.tensors}
        stored = 0
        for f in futures:
            for name, rec in f.result():
                tensors[name].chunks.append(rec)
                stored += rec.length
        m = Manifest(step=slot.step, world=self.world, layout=self.layout, config_digest=self.config_digest,
                     attempt=adir, tensors=tensors, values=slot.values,
                     rank_extras={self.rank: slot.extra}, extra=slot.global_extra if self.rank == 0 else None,
                     created=time.time(), rank=self.rank, epoch=self.epoch)
        doc = manifest_to_json(m)
        if self.auth is not None:
            doc = self.auth.sign_manifest(doc)
        path = f"{vdir}/{rank_manifest_name(adir, self.rank)}"
        with_retry(lambda: self.sink.write_manifest(path, doc),
                   path, self.opts.retry)
        seconds = time.monotonic() - t0
        raw = sum(c.nbytes for c in slot.plan.chunks)
        self.last_uploaded = slot.step
        emit(self.events, "upload", step=slot.step, bytes=raw, stored_bytes=stored, parts=len(futures),
             seconds=round(seconds, 4), mb_s=round(raw / max(seconds, 1e-9) / 1e6, 1), retries=retries[0])
        if self.committer is not None:
            self.committer.add(slot.step, adir)
        self.sink.landed()

    def close(self, timeout: timedelta) -> None:
        """Finish the pending writes, waiting at most ``timeout``: past it, a write still
        running is left to the daemon threads (its version is never committed)."""
        idle = self.ring.wait_idle(timeout, self.consumer)
        self._stop.set()
        self.ring.wake()
        self._thread.join(timeout.total_seconds())
        self._pool.shutdown(wait=idle)


class Committer:
    """Rank 0's thread that turns fully uploaded versions into complete ones."""

    def __init__(self, fs, root: str, world: int, opts: DurableOptions, events: Any, url: str,
                 auth: VersionAuth | None = None):
        self.fs, self.root, self.world, self.opts, self.events, self.url = fs, root, world, opts, events, url
        # Checks each rank manifest's MAC before merging and signs the global manifest: what it
        # signs must be what the ranks wrote, not what someone else put beside them.
        self.auth = auth
        self.committed: int | None = None
        self.floor: int | None = None  # retention keeps the newest version at or below it
        self._pending: dict[int, tuple[str, float]] = {}  # step -> (attempt dir, since)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="snapshot-committer", daemon=True)
        self._thread.start()

    def add(self, step: int, attempt_dir: str) -> None:
        with self._cond:
            self._pending[step] = (attempt_dir, time.monotonic())
            self._cond.notify_all()

    def _run(self) -> None:
        delay = 0.01
        while True:
            with self._cond:
                if not self._pending:
                    if self._stop:
                        return
                    self._cond.wait(0.5)
                    delay = 0.01
                    continue
                steps = sorted(((s, a) for s, (a, _) in self._pending.items()), reverse=True)
            progressed = False
            for step, adir in steps:
                try:
                    if self._try_commit(step, adir):
                        progressed = True
                        break
                except Exception as e:
                    self._drop(step)
                    if isinstance(e, SnapshotError):
                        report_auth(self.events, e)  # a rank manifest that fails its MAC: auth_failure
                    emit(self.events, "upload_error", step=step, phase="commit",
                         error=f"{type(e).__name__}: {e}", obj=getattr(e, "obj", None))
                    warnings.warn(f"snapshot commit of step {step} failed, training goes on: {e}", RuntimeWarning)
            self._expire()
            if not progressed:
                with self._cond:
                    self._cond.wait(delay)
                delay = min(delay * 2, 1.0)
            else:
                delay = 0.01

    def _drop(self, step: int) -> None:
        with self._cond:
            self._pending.pop(step, None)
            self._cond.notify_all()

    def _expire(self) -> None:
        now, limit = time.monotonic(), self.opts.commit_timeout.total_seconds()
        with self._cond:
            for step, (_, since) in list(self._pending.items()):
                stale = self.committed is not None and step < self.committed
                if stale or now - since > limit:
                    del self._pending[step]
                    if not stale:
                        emit(self.events, "upload_error", step=step, phase="commit",
                             error=f"not every rank uploaded step {step} within {self.opts.commit_timeout}")
            self._cond.notify_all()

    def _try_commit(self, step: int, attempt_dir: str) -> bool:
        vdir = f"{self.root}/{version_dir(step)}"
        adir = f"{vdir}/{attempt_dir}"
        def listing() -> set[str]:
            self.fs.invalidate_cache(adir)
            return {p.rsplit("/", 1)[-1] for p in self.fs.ls(adir, detail=False)}

        try:
            names = with_retry(listing, adir, self.opts.retry)
        except FileNotFoundError:
            return False
        if sum(1 for r in range(self.world) if f"r{r:05d}.json" in names) < self.world:
            return False
        t0 = time.monotonic()
        parts = []
        for r in range(self.world):
            path = f"{vdir}/{rank_manifest_name(attempt_dir, r)}"
            data = with_retry(lambda: self.fs.cat_file(path), path, self.opts.retry)
            if self.auth is not None:
                data = self.auth.open_manifest(data, path)
            part = manifest_from_json(data, path)
            if (part.rank, part.step, part.attempt) != (r, step, attempt_dir):
                raise SnapshotError(f"{path}: holds rank {part.rank} of step {part.step} ({part.attempt}), not rank "
                                    f"{r} of step {step} ({attempt_dir})", path)
            parts.append(part)
        m = merge_rank_manifests(parts, vdir)
        doc = manifest_to_json(m)
        if self.auth is not None:
            doc = self.auth.sign_manifest(doc)
        path = f"{vdir}/{MANIFEST_NAME}"

        def put_and_check() -> None:
            write_object(self.fs, path, [doc], len(doc))
            if self.fs.cat_file(path) != doc:
                raise OSError(f"{path}: manifest read back differs from what was written")

        with_retry(put_and_check, path, self.opts.retry)
        # the event first: whoever wait()s for this commit then finds it in the log too
        emit(self.events, "commit", tier="durable", step=step, url=f"{self.url.rstrip('/')}/{version_dir(step)}",
             world=self.world, tensors=len(m.tensors), bytes=m.nbytes, seconds=round(time.monotonic() - t0, 4))
        with self._cond:
            self.committed = step if self.committed is None else max(self.committed, step)
            self._pending.pop(step, None)
            self._cond.notify_all()
        with self._cond:
            protect = set(self._pending)
        try:
            removed, kept = with_retry(
                lambda: collect_garbage(self.fs, self.root, self.opts.keep_last, self.opts.keep_every, protect,
                                        self.floor),
                self.root, self.opts.retry)
        except Exception as e:  # retention failing must not undo a commit
            emit(self.events, "upload_error", step=step, phase="gc", error=f"{type(e).__name__}: {e}")
            return True
        if removed:
            emit(self.events, "gc", removed=removed, kept=kept, step=step)
        return True

    def wait_idle(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: timedelta) -> None:
        self.wait_idle(timeout)
        with self._cond:
            self._stop = True
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout.total_seconds())
