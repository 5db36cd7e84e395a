"""The worker's side of the heartbeat (the agent's: :mod:`resilient.agent.heartbeat`).

A worker touches the file its agent named (:data:`~resilient.contract.HEARTBEAT_ENV`) after
each step; it also tells its agent, through files beside it, that its device is bad
(:data:`~resilient.contract.QUARANTINE_SUFFIX`), and reads why the agent stops it
(:data:`~resilient.contract.STOP_REASON`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

from resilient.contract import HEARTBEAT_ENV, QUARANTINE_SUFFIX, STOP_REASON


class HeartbeatWriter:
    """The worker side. A writer without a path (not under an agent) does nothing."""

    def __init__(self, path: str | None):
        self.path = path

    @classmethod
    def from_env(cls) -> "HeartbeatWriter":
        return cls(os.environ.get(HEARTBEAT_ENV))

    def beat(self) -> None:
        if self.path:
            try:
                os.utime(self.path, None)
            except FileNotFoundError:
                Path(self.path).touch()

    def mark_quarantine(self) -> None:
        """This worker's device is confirmed bad and it is about to leave: tell its agent
        now. The exit code (WorkerExit.QUARANTINE) comes only once the process is gone, and by
        then the other nodes, whose workers left at the same barrier, may already wait in
        the next round: an agent that sees them waiting restarts (kills) its workers and
        never sees the code."""
        if self.path:
            Path(self.path + QUARANTINE_SUFFIX).touch()

    def stop_reason(self) -> str | None:
        """Why the agent stops this worker, when it decided so (HeartbeatMonitor.announce_stop);
        None for a SIGTERM from outside (a preemption) or outside an agent."""
        if not self.path:
            return None
        try:
            return (Path(self.path).parent / STOP_REASON).read_text()[:500] or None
        except OSError:
            return None

    @contextlib.contextmanager
    def while_waiting(self, every: timedelta = timedelta(seconds=1), limit: timedelta | None = None):
        """Beat from a thread during a long wait that has its own bound (the
        final upload, shutdown): the agent must not take it for a hang. With
        ``limit``, the beats stop after that long: a wait that outlasts it is
        judged by the agent's deadline again, from its last beat."""
        stop = threading.Event()
        until = None if limit is None else time.monotonic() + limit.total_seconds()

        def loop() -> None:
            while not stop.wait(every.total_seconds()):
                if until is not None and time.monotonic() >= until:
                    return
                self.beat()

        thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
