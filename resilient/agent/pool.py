"""Worker processes for the agent: cold-spawned or taken warm from a pool.

A :class:`WorkerProcess` is a ``python -m resilient.agent.warm`` child that
has (or is still) importing torch and waits for an assignment on stdin.
:class:`WarmPool` keeps ``size`` of them idle; :meth:`WarmPool.take` hands
one out (spawning a cold one if the pool is empty) and the pool refills in
the background, after a delay so refills do not compete for CPU with the
workers that just started.

Every child runs in its own process group and asks the kernel to kill it
when its parent dies (``PR_SET_PDEATHSIG``, set by the child itself in
:mod:`.warm`), so an agent killed with SIGKILL leaves no workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

class WorkerProcess:
    """One child process: warm until :meth:`assign`, then a worker."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient.agent.warm"],
            stdin=subprocess.PIPE, env={**os.environ, **env, "RESILIENT_PARENT_PID": str(os.getpid())},
            process_group=0,  # its own group: a kill reaches anything it started
        )
        self.born = time.monotonic()
        self.assigned = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def assign(self, env: dict[str, str], argv: list[str]) -> None:
        line = json.dumps({"env": env, "argv": argv}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.close()
        self.assigned = True

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: timedelta) -> int | None:
        try:
            return self.proc.wait(timeout.total_seconds())
        except subprocess.TimeoutExpired:
            return None

    def discard(self) -> None:
        """Drop an unassigned warm process: closing stdin makes it exit 0."""
        if not self.assigned and self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.kill()
        self.wait(timedelta(seconds=5))


class WarmPool:
    """Keeps ``size`` warm processes ready. Thread-safe."""

    def __init__(self, size: int, env: dict[str, str], refill_delay: timedelta = timedelta(seconds=2)):
        self.size = size
        self.env = env
        self.refill_delay = refill_delay
        self._idle: list[WorkerProcess] = []
        self._lock = threading.Lock()
        self._closed = False
        self._timer: threading.Timer | None = None

    def fill(self) -> None:
        with self._lock:
            while not self._closed and len(self._idle) < self.size:
                self._idle.append(WorkerProcess(self.env))

    def take(self) -> tuple[WorkerProcess, bool]:
        """A process for a worker, and whether it came warm from the pool."""
        with self._lock:
            while self._idle:
                wp = self._idle.pop(0)
                if wp.poll() is None:
                    return wp, True
            return WorkerProcess(self.env), False

    def refill_later(self, delay: timedelta | None = None) -> None:
        """Top the pool up after ``delay`` (default ``refill_delay``), on a timer thread."""
        if self.size <= 0:
            return
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            wait = self.refill_delay if delay is None else delay
            self._timer = threading.Timer(wait.total_seconds(), self.fill)
            self._timer.daemon = True
            self._timer.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            idle, self._idle = self._idle, []
        for wp in idle:
            wp.discard()
