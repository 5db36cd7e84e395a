"""Shared mappings of node-store files: a file written again reuses the mapping it had.

Why here, apart from the store: the writers of both sides use them (a rank writing its
version, :func:`~resilient.snapshot.storage.write_object`; the agent receiving a peer's
push, :class:`~resilient.snapshot.nodestore.AtomicWriter`), and the store drops them all
when it goes (a mapping keeps a deleted file's pages alive).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Iterable

__all__ = ["Mappings", "MAPPINGS", "mapped", "write_mapped"]


class Mappings:
    """Shared mappings of store files, kept open across writes: a file written again
    (a spare claimed back) reuses the mapping it had.

    Why: on this VM, mapping a 7 MB tmpfs file costs ~7 ms of kernel time (a page-table
    entry per 4 KiB page, ``MAP_POPULATE`` or not), ``write`` as much; the copy into an
    existing mapping ~1 ms. Every version rewrites the same spares (:class:`~resilient.snapshot.nodestore.Spares` hands a
    writer back the files of its own rank), so after the first versions each write is a copy.

    Entries are keyed by inode. A mapping of a live file costs no memory of its own (the
    pages are the file's), but it keeps a deleted file's pages alive: entries whose file has
    no name left are dropped (:meth:`prune`) before any write reserves space, so the space a
    process holds this way is freed before it could make that write fail, and otherwise at
    most every ``prune_every`` (a check is an ``fstat`` per entry, on every write). At most
    ``limit`` are kept, least recently used out first: a node's writers cycle through about
    (ranks' parts) x (versions kept + 2) files. Thread-safe; a mapping is written by one
    writer at a time (only the writer that claimed a file writes it), and :meth:`view`
    exports it under the lock, so a concurrent :meth:`prune` or :meth:`clear` cannot close
    it under the writer (closing a mapping with an exported view fails, and is left to GC)."""

    limit = 256
    prune_every = timedelta(seconds=1)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[int, int], tuple[int, mmap.mmap]] = OrderedDict()
        self._pruned = 0.0

    def view(self, f, size: int) -> memoryview:
        """A writable view of a shared mapping of at least the first ``size`` bytes of the
        open file ``f`` (release it when done)."""
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino)
        with self._lock:
            got = self._maps.pop(key, None)
            if got is not None and len(got[1]) >= size:
                self._maps[key] = got
                return memoryview(got[1])
            if got is not None:
                self._close(got)
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        with self._lock:
            self._maps[key] = (os.dup(f.fileno()), mm)
            while len(self._maps) > self.limit:
                self._close(self._maps.popitem(last=False)[1])
            return memoryview(mm)

    def prune(self, force: bool = True) -> None:
        """Drop the mappings of files that were deleted (unless ``force``, only if the last
        look is ``prune_every`` old)."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._pruned < self.prune_every.total_seconds():
                return
            self._pruned = now
            for key, entry in list(self._maps.items()):
                try:
                    gone = os.fstat(entry[0]).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    self._close(self._maps.pop(key))

    @staticmethod
    def _close(entry: tuple[int, mmap.mmap]) -> None:
        fd, mm = entry
        try:
            mm.close()
        except BufferError:  # a view is still exported (a writer mid-copy): GC closes it after
            pass
        os.close(fd)

    def clear(self) -> None:
        """Drop every mapping (the store is going away)."""
        with self._lock:
            while self._maps:
                self._close(self._maps.popitem()[1])


MAPPINGS = Mappings()


@contextlib.contextmanager
def mapped(f, size: int):
    """A writable view of the first ``size`` bytes of the open file ``f``, through a shared
    mapping (:data:`MAPPINGS`); afterwards ``f`` is positioned at ``size`` (where a
    ``truncate()`` cuts a rewritten spare that was longer).

    The space is reserved first (``posix_fallocate``) unless the file already holds every
    page (a rewritten spare: the call alone cost ~3 ms per 7 MB here): a full tmpfs then
    fails here with ENOSPC, never with a SIGBUS on a mapped page."""
    f.truncate(size)
    reserve = size > 0 and os.fstat(f.fileno()).st_blocks * 512 < size
    MAPPINGS.prune(force=reserve)  # before reserving: deleted files' pages this process holds are space
    if size:
        if reserve:
            os.posix_fallocate(f.fileno(), 0, size)
        with MAPPINGS.view(f, size) as whole, whole[:size] as view:
            yield view
    else:
        yield memoryview(b"")
    f.seek(size)


def write_mapped(f, pieces: Iterable[Any], size: int) -> None:
    """Write ``pieces`` (bytes-like, exactly ``size`` bytes in all) at the start of ``f``
    through :func:`mapped`; :class:`OSError` if they add up to another size."""
    at = 0
    with mapped(f, size) as whole:
        for p in pieces:
            with memoryview(p) as v, v.cast("B") as b:
                if at + len(b) > size:
                    raise OSError(f"{f.name}: pieces exceed the {size} bytes planned")
                whole[at:at + len(b)] = b
                at += len(b)
    if at != size:
        raise OSError(f"{f.name}: pieces add up to {at} bytes, {size} were planned")
