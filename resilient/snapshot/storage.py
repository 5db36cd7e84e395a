"""fsspec access for the durable tier: open a URL, retry, write atomically.

Every call to storage goes through :func:`with_retry`: transient errors
(``OSError`` and its kin, which is what s3fs/botocore and local disks raise)
are retried with exponential backoff and jitter until a deadline; anything
else is a bug and propagates at once.

Writes are *atomic* per object: on a local filesystem a temporary file is
fsynced and renamed into place; object stores (S3, GCS, ...) already make a PUT visible
all at once. After writing, the object's size is checked, which catches a
write that was torn without an error.
"""

from __future__ import annotations

import errno
import os
import random
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from resilient.snapshot.api import SnapshotCorrupt, SnapshotIncomplete, StorageError
from resilient.snapshot.mapping import write_mapped
from resilient.snapshot.nodestore import OWNER, Spares, make_version_dirs, open_for_rewrite, readinto_at

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: ``initial`` doubling up to ``maximum``, given up after ``deadline``."""

    initial: timedelta = timedelta(milliseconds=50)
    maximum: timedelta = timedelta(seconds=5)
    deadline: timedelta = timedelta(minutes=2)
    attempts: int = 12


TRANSIENT = (OSError, TimeoutError, ConnectionError)
# Errors a retry cannot mend: a full or read-only disk, a refused permission. Retrying
# them only held the caller for the whole deadline (~30 s per write on a full disk).
PERMANENT = {errno.ENOSPC: "no space left on the device: free some, or point the URL elsewhere",
             errno.EDQUOT: "disk quota exceeded: free some, or point the URL elsewhere",
             errno.EROFS: "read-only file system: point the URL at a writable place",
             errno.EACCES: "permission denied: check the path's permissions or the credentials",
             errno.EPERM: "operation not permitted: check the path's permissions or the credentials",
             errno.ENOTDIR: "a file stands where a directory of the URL should be: fix the URL or move the file",
             errno.EISDIR: "a directory stands where a file should be: fix the URL or move the directory"}


def with_retry(fn: Callable[[], T], what: str, policy: RetryPolicy,
               on_retry: Callable[[int, BaseException], None] | None = None) -> T:
    """Run ``fn`` until it succeeds; raise :class:`StorageError` naming ``what`` when it never does.

    ``FileNotFoundError`` is not transient for reads; callers that expect it
    catch it themselves (it propagates unchanged)."""
    start = time.monotonic()
    delay = policy.initial.total_seconds()
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except TRANSIENT as e:
            if isinstance(e, OSError) and e.errno in PERMANENT:
                raise StorageError(f"{what}: {PERMANENT[e.errno]} ({type(e).__name__}: {e})", what) from e
            elapsed = time.monotonic() - start
            if attempt == policy.attempts or elapsed + delay > policy.deadline.total_seconds():
                raise StorageError(
                    f"{what}: still failing after {attempt} attempts over {elapsed:.1f}s ({type(e).__name__}: {e}); "
                    "check the storage URL, credentials and network", what) from e
            if on_retry is not None:
                on_retry(attempt, e)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, policy.maximum.total_seconds())
    raise AssertionError("unreachable")


def open_url(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) of an fsspec URL; a bare path means ``file://``."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, root.rstrip("/")


def node_store_path(fs: fsspec.AbstractFileSystem, root: str) -> Path | None:
    """``root`` as a path if it is an agent's node store (it holds the owner file), so a
    rank's writer can rewrite its spare files and ring its doorbell; else None."""
    if not isinstance(fs, LocalFileSystem):
        return None
    path = Path(fs._strip_protocol(root))
    return path if (path / OWNER).is_file() else None


def is_remote(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether the link is slow enough that compressing 16-bit floats pays."""
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return not any(p in ("file", "local", "memory") for p in protos)


def _write_local(path: str, pieces: Iterable[Any], spares: Spares | None = None, size: int | None = None,
                 in_store: bool = False) -> None:
    """Temp file, fsync, rename, fsync the directory: the object is whole or absent, even after a power cut.
    ``spares``: a node store's retired files, one of which is rewritten in place if left;
    there, with ``size`` known beforehand, the bytes go in through a mapping
    (:func:`~resilient.snapshot.mapping.write_mapped`: tmpfs ``write`` is ~7x its cost)."""
    parent = os.path.dirname(path)
    if spares is not None or in_store:  # a node store: 0700 version directories, never the store itself
        make_version_dirs(Path(parent))
    else:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open_for_rewrite(Path(tmp), spares, os.path.basename(path)) as f:
            if spares is not None and size is not None:
                write_mapped(f, pieces, size)
            else:
                for p in pieces:
                    f.write(p)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new link) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_object(fs: fsspec.AbstractFileSystem, path: str, pieces: Iterable[Any],
                 size: int | Callable[[], int], spares: Spares | None = None, in_store: bool = False) -> None:
    """Write the concatenation of ``pieces`` (bytes-like) to ``path`` atomically, then check
    its size (``size`` may be a callable, for pieces produced while writing; an int, known
    beforehand, lets a node store take the bytes through a mapping)."""
    if isinstance(fs, LocalFileSystem):
        _write_local(fs._strip_protocol(path), pieces, spares, size if isinstance(size, int) else None, in_store)
    else:
        with fs.open(path, "wb") as f:
            for p in pieces:
                f.write(p)
    fs.invalidate_cache(path)
    got = fs.size(path)
    size = size() if callable(size) else size
    if got != size:
        raise OSError(f"{path}: wrote {size} bytes but storage holds {got} (torn write)")


def _missing(path: str) -> SnapshotIncomplete:
    return SnapshotIncomplete(f"{path}: object is missing; the version is incomplete", path)


def _truncated(path: str, start: int, end: int, got: int) -> SnapshotCorrupt:
    return SnapshotCorrupt(
        f"{path}: object is truncated (wanted bytes {start}-{end}, got {got} bytes); "
        "the version is damaged, restore falls back to an older one", path)


def read_range(fs: fsspec.AbstractFileSystem, path: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``path``; :class:`SnapshotIncomplete` if missing or short."""
    try:
        data = fs.cat_file(path, start=start, end=end)
    except FileNotFoundError:
        raise _missing(path) from None
    if len(data) != end - start:
        raise _truncated(path, start, end, len(data))
    return data


def read_range_into(fs: fsspec.AbstractFileSystem, path: str, start: int, out: memoryview) -> None:
    """Read ``len(out)`` bytes of a local file from ``start`` into ``out`` (no intermediate
    bytes object); the same errors as :func:`read_range`."""
    try:
        got = readinto_at(fs._strip_protocol(path), start, out)
    except FileNotFoundError:
        raise _missing(path) from None
    if got != len(out):
        raise _truncated(path, start, start + len(out), got)
