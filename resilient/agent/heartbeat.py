"""Worker heartbeats, so the agent can tell a hung worker from a slow one.

A worker touches its heartbeat file (``os.utime``, no data written) after
each step; the agent compares the file's mtime with the clock. A worker that
is stopped (SIGSTOP), deadlocked, or stuck in a collective whose peer is gone
stops beating and is killed after the timeout. Beats come from the training
loop itself, not a side thread, so a hung loop cannot keep beating.

Before its first beat a worker is importing, building its model and restoring
state: that phase gets its own, longer timeout.

This is the agent's side; the worker's is :mod:`resilient.job.heartbeat`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path

from resilient.contract import QUARANTINE_SUFFIX, STOP_REASON

class HeartbeatMonitor:
    """The agent side (the worker's is :class:`resilient.job.heartbeat.HeartbeatWriter`): one file
    per local worker in a private directory."""

    # The deadline follows the job's real steps: STEP_MULTIPLE times the longest of the last
    # RECENT gaps between beats (checked SDC steps, evals, a loaded host all included), never
    # below ``timeout``. A fixed 30 s killed healthy workers whose checked steps took longer.
    STEP_MULTIPLE = 4
    RECENT = 32

    def __init__(self, directory: Path, timeout: timedelta, startup_timeout: timedelta):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._started: dict[int, float] = {}
        self._last_beat: dict[int, float] = {}
        self._gaps: dict[int, collections.deque] = {}

    def deadline(self, local_rank: int) -> float:
        """Seconds a worker that has beaten may stay silent: ``timeout``, or more when its
        steps take longer (:data:`STEP_MULTIPLE` × its longest recent gap between beats)."""
        gaps = self._gaps.get(local_rank)
        return max(self.timeout.total_seconds(), self.STEP_MULTIPLE * max(gaps, default=0.0) if gaps else 0.0)

    def _observe(self, local_rank: int, mtime: float) -> None:
        last = self._last_beat.get(local_rank)
        if last is not None and mtime > last:
            self._gaps.setdefault(local_rank, collections.deque(maxlen=self.RECENT)).append(mtime - last)
        if last is None or mtime > last:
            self._last_beat[local_rank] = mtime

    def path(self, local_rank: int) -> str:
        return str(self.dir / f"worker{local_rank}.beat")

    def reset(self, local_rank: int) -> None:
        """A new worker takes the slot: forget the old one's beats."""
        p = Path(self.path(local_rank))
        p.unlink(missing_ok=True)
        Path(self.path(local_rank) + QUARANTINE_SUFFIX).unlink(missing_ok=True)
        self._started[local_rank] = time.time()
        self._last_beat.pop(local_rank, None)  # the step times stay: the job's steps, whoever takes them

    def announce_stop(self, reason: str) -> None:
        """Tell the workers, before their SIGTERM, that this stop is the agent's own (``reason``)."""
        with contextlib.suppress(OSError):
            (self.dir / STOP_REASON).write_text(reason)

    def quarantine_marked(self, local_rank: int) -> bool:
        """Whether the worker said its device is bad (HeartbeatWriter.mark_quarantine)."""
        return os.path.exists(self.path(local_rank) + QUARANTINE_SUFFIX)

    def silent_for(self, local_rank: int) -> tuple[float, float] | None:
        """(seconds since the last beat, the timeout that applies), or None if fine."""
        now = time.time()
        try:
            last = os.stat(self.path(local_rank)).st_mtime
            self._observe(local_rank, last)
            limit = self.deadline(local_rank)
        except FileNotFoundError:
            last, limit = self._started.get(local_rank, now), self.startup_timeout.total_seconds()
        quiet = now - last
        return (quiet, limit) if quiet > limit else None
