"""Write a new snapshot version chunk by chunk, in the standard format.

Reshard and import produce versions that the normal restore path reads: the
same manifest (``resilient.snapshot.format``), objects under a fresh ATTEMPT
directory, CRC-32 per chunk, and ``manifest.json`` written last, so a run cut
short never leaves a wrong version. :meth:`VersionWriter.abort` deletes what
the attempt wrote: ``gc`` keeps incomplete versions newer than the newest
complete one (they may still be uploading), so in a fresh OUT debris would
stay forever and block a rerun. A version already at the step is refused
(complete or not) unless ``force``: then the new attempt is written beside
it and the old one is removed only after the new manifest is in place, so an
interrupted forced run loses nothing.

Chunks are appended to one part object at a time (rolled over at
``part_bytes``), so memory holds one chunk, whatever the version's size.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from resilient.snapshot.api import ChunkRecord, Manifest, TensorRecord
from resilient.snapshot.auth import VersionAuth
from resilient.snapshot.boxes import Box, split_rows
from resilient.snapshot.format import (
    MANIFEST_NAME, checksum, compress, dtype_name, manifest_to_json, should_compress, version_dir,
)
from resilient.snapshot.storage import RetryPolicy, is_remote, open_url, with_retry, write_object

from resilient_tools.blocks import itemsize, tensor_bytes
from resilient_tools.errors import CkptToolError, OutputExists


class _Part:
    """One object being written: a temp file renamed into place on a local disk, a stream elsewhere."""

    def __init__(self, fs, path: str):
        self.fs, self.path, self.size = fs, path, 0
        if isinstance(fs, LocalFileSystem):
            local = fs._strip_protocol(path)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self._tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
            self._f = open(self._tmp, "wb")
        else:
            self._tmp = None
            self._f = fs.open(path, "wb")

    def write(self, data: Any) -> int:
        at = self.size
        self._f.write(data)
        self.size += len(data)
        return at

    def close(self) -> None:
        if self._tmp is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.fs._strip_protocol(self.path))
        else:
            self._f.close()
        self.fs.invalidate_cache(self.path)
        got = self.fs.size(self.path)
        if got != self.size:
            raise OSError(f"{self.path}: wrote {self.size} bytes but storage holds {got} (torn write)")

    def abort(self) -> None:
        try:
            self._f.close()
            if self._tmp is not None:
                os.unlink(self._tmp)
        except OSError:
            pass


class VersionWriter:
    """Builds version ``step`` under ``url``: declare tensors, append their chunks, :meth:`commit`.

    ``compress``: ``none``, ``zstd`` or ``auto`` (the writer's policy: zstd
    for 16-bit floats on remote URLs only)."""

    def __init__(self, url: str, step: int, *, world: int = 1, layout: dict | None = None,
                 config_digest: str = "", values: dict | None = None, rank_extras: dict | None = None,
                 extra: Any = None, compress: str = "auto", chunk_bytes: int = 16 << 20,
                 part_bytes: int = 64 << 20, storage_options: dict | None = None,
                 retry: RetryPolicy = RetryPolicy(), force: bool = False, secret=None):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CkptToolError(f"step must be a non-negative integer (got {step!r}); a negative step makes a "
                                "version folder no reader lists")
        self.url, self.step = url, step
        from resilient_tools import source
        self.fs, self.root = open_url(url, storage_options if storage_options is not None
                                      else source.STORAGE_OPTIONS or None)
        secret = secret if secret is not None else source.SECRET
        self.auth = VersionAuth(secret) if secret is not None else None  # signs chunks and manifest
        self.vdir = f"{self.root}/{version_dir(step)}"
        if self.fs.isfile(self.root):
            raise OutputExists(f"{url}: is a file; the output of reshard/import is a checkpoint folder (it will "
                               "hold step-* folders); choose another OUT")
        self.root_existed = self.fs.exists(self.root)
        self.existed = self.root_existed and self.fs.exists(self.vdir)
        if self.existed and not force:
            if self.fs.exists(f"{self.vdir}/{MANIFEST_NAME}"):
                raise OutputExists(f"{url}: already holds a complete version at step {step} ({self.vdir}); write "
                                   "to another OUT, or pass --force to replace it")
            raise OutputExists(f"{url}: step {step} is there but incomplete ({self.vdir} has no {MANIFEST_NAME}: "
                               "debris of an interrupted write, or a write still running); pass --force to replace "
                               "it, or delete that folder")
        self.attempt = uuid.uuid4().hex[:12]
        self.compress_policy, self.remote = compress, is_remote(self.fs)
        self.chunk_bytes, self.part_bytes, self.retry = chunk_bytes, part_bytes, retry
        self.manifest = Manifest(step=step, world=world, layout=dict(layout or {"world": world}),
                                 config_digest=config_digest, attempt=self.attempt, tensors={},
                                 values=dict(values or {}), rank_extras=dict(rank_extras or {}), extra=extra)
        self._part: _Part | None = None
        self._parts = 0
        self._committing = False
        self.bytes_written = 0

    def add_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.manifest.tensors[name] = TensorRecord(name, tuple(shape), dtype_name(dtype), [])

    def write(self, name: str, box: Box, values: torch.Tensor) -> None:
        """Store ``values`` (the elements of ``box`` of tensor ``name``), cut into chunks of at most ``chunk_bytes``."""
        rec = self.manifest.tensors[name]
        if box.numel == 0 and box.sizes:
            return
        for row, sub in split_rows(box, itemsize(values.dtype), self.chunk_bytes):
            part = values[row:row + sub.sizes[0]] if box.sizes else values
            self._append(rec, sub, part)

    def _append(self, rec: TensorRecord, box: Box, values: torch.Tensor) -> None:
        raw = tensor_bytes(values)
        data, how = raw, "none"
        if should_compress(self.compress_policy, values.dtype, self.remote):
            packed = compress(raw)
            if len(packed) <= 0.97 * len(raw):
                data, how = packed, "zstd"
        if self._part is None or (self._part.size and self._part.size + len(data) > self.part_bytes):
            self._roll()
        at = self._part.write(data)
        rec.chunks.append(ChunkRecord(
            object=self._part_name, offset=at, length=len(data), raw_length=len(raw),
            offsets=box.offsets, sizes=box.sizes, checksum=checksum(data), compression=how,
            mac=self.auth.chunk_mac(self.step, self.attempt, raw) if self.auth is not None else ""))
        self.bytes_written += len(data)

    def _roll(self) -> None:
        if self._part is not None:
            self._part.close()
        self._part_name = f"{self.attempt}/tool-p{self._parts:05d}.bin"
        self._parts += 1
        self._part = _Part(self.fs, f"{self.vdir}/{self._part_name}")

    def commit(self) -> str:
        """Close the last part and write ``manifest.json`` (read back and compared). Returns the version's URL."""
        self._committing = True
        if self._part is not None:
            self._part.close()
            self._part = None
        self.manifest.created = time.time()
        doc = manifest_to_json(self.manifest)
        if self.auth is not None:
            doc = self.auth.sign_manifest(doc)
        path = f"{self.vdir}/{MANIFEST_NAME}"

        def put_and_check() -> None:
            write_object(self.fs, path, [doc], len(doc))
            if self.fs.cat_file(path) != doc:
                raise OSError(f"{path}: manifest read back differs from what was written")

        with_retry(put_and_check, path, self.retry)
        if self.existed:
            self._drop_others()
        return f"{self.url.rstrip('/')}/{version_dir(self.step)}"

    def _drop_others(self) -> None:
        """After a forced commit: remove what the replaced version left in the folder (its attempt,
        temp files), now that our manifest names only our attempt."""
        keep = {MANIFEST_NAME, self.attempt}
        self.fs.invalidate_cache(self.vdir)
        for entry in self.fs.ls(self.vdir, detail=False):
            if entry.rstrip("/").rsplit("/", 1)[-1] not in keep:
                try:
                    with_retry(lambda: self.fs.rm(entry, recursive=True), entry, self.retry)
                except FileNotFoundError:
                    pass

    def _maybe_committed(self) -> bool:
        """Whether the version's manifest may be ours (a commit cut short after writing it)."""
        try:
            doc = self.fs.cat_file(f"{self.vdir}/{MANIFEST_NAME}")
        except FileNotFoundError:
            return False
        except OSError:
            return True
        try:
            return json.loads(doc).get("attempt") == self.attempt
        except (ValueError, AttributeError):
            return True

    def abort(self) -> None:
        """Delete what this attempt wrote (and the version folder, if this writer created it and it
        is empty), so a rerun is not blocked and ``gc`` has nothing to keep forever. Best effort:
        a storage error here must not hide the error that caused the abort."""
        if self._part is not None:
            self._part.abort()
            self._part = None
        if self._committing and self._maybe_committed():
            return  # the manifest naming our objects may be in place: deleting them would break it
        if self._parts:
            try:
                self.fs.rm(f"{self.vdir}/{self.attempt}", recursive=True)
            except OSError:  # FileNotFoundError included: nothing of ours reached storage
                pass
        try:
            # object stores have no folders: only local ones this writer made are left, empty
            for folder, made in ((self.vdir, not self.existed), (self.root, not self.root_existed)):
                self.fs.invalidate_cache(folder)
                if made and self.fs.isdir(folder) and not self.fs.ls(folder, detail=False):
                    self.fs.rmdir(folder)
        except (OSError, NotImplementedError):
            pass
        self.fs.invalidate_cache(self.root)
