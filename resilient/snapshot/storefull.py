"""A node store that fills up at run time: one warning with the right fix, once a minute.

Why: a node store (``snapshot.store_dir``, tmpfs under ``/dev/shm`` by default) that
fills mid-run makes every rank's write of every step fail with ENOSPC. Training goes on
(the other tiers still hold the job: older versions in RAM, the peers' copies, durable
storage), but a warning per rank per step buried the run's output under the durable
tier's hint ("point the URL elsewhere"), which is not the fix here. So a rank that finds
the node store full says so here instead: one warning naming the fix, at most once a
minute for the whole node (its ranks share a marker file in the store, which a full tmpfs
still lets them create: it takes an inode, not a block). The agent, which owns the store,
sees the marker's time change and records a ``store_full`` event (:func:`full_since`).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path

__all__ = ["out_of_space", "report_store_full", "full_since", "STORE_FULL_EVERY"]

STORE_FULL_EVERY = timedelta(minutes=1)
MARK = ".full-warned"  # its mtime: when a rank of this node last warned


def out_of_space(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) is a full filesystem or quota."""
    seen = 0
    while error is not None and seen < 8:  # the OSError sits under a StorageError
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _first_in(mark: Path, every: timedelta) -> bool:
    """True for the first caller of this node within ``every`` (the marker's mtime says when
    the last one was); True too when the marker cannot be used (better twice than never)."""
    try:
        if time.time() - mark.stat().st_mtime < every.total_seconds():
            return False
        mark.unlink()  # stale: whoever creates it anew warns
    except FileNotFoundError:
        pass
    except OSError:
        return True
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False  # another rank just did
    except OSError:
        pass
    return True


def report_store_full(store: Path, step: int, every: timedelta = STORE_FULL_EVERY) -> bool:
    """Warn that ``step`` could not land in the node store ``store`` because it is full,
    unless a rank of this node did less than ``every`` ago. Returns whether it did."""
    if not _first_in(store / MARK, every):
        return False
    try:
        free = shutil.disk_usage(store).free
    except OSError:
        free = 0
    warnings.warn(
        f"node store {store} is full ({free >> 20} MiB free): step {step} and the next ones are not kept in this "
        f"node's RAM; training goes on with the other tiers (the versions already there, the peers' copies, "
        f"durable storage). Enlarge /dev/shm (or the filesystem of snapshot.store_dir) or lower "
        f"snapshot.store_keep. (Said at most once every {every.total_seconds():.0f} s.)", RuntimeWarning, stacklevel=2)
    return True


def full_since(store: Path, seen: float) -> float | None:
    """The time a rank last warned that ``store`` is full, if later than ``seen``; else None."""
    try:
        mtime = (store / MARK).stat().st_mtime
    except OSError:
        return None
    return mtime if mtime > seen else None
