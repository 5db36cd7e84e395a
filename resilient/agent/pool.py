"""Worker processes for the agent: cold-spawned or forked from a warm zygote.

A :class:`WorkerProcess` is a ``python -m resilient.agent.warm`` child that
has (or is still) importing torch and the program's preload list, and waits
for an assignment on stdin: a cold start. With spares (``size > 0``) :class:`WarmPool` instead keeps one
:class:`Zygote`, a process that imported everything once and forks a worker
per assignment (~30 ms), so every restart is warm however soon it follows
the previous one (re-spawned spares needed 10-30 s to import on the soak's
shared cores and were taken half-imported). A zygote that dies is replaced.

Every child runs in its own process group and asks the kernel to kill it
when its parent dies (``PR_SET_PDEATHSIG``, set by the child itself in
:mod:`.warm`), so an agent killed with SIGKILL leaves no workers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

from resilient.agent.api import AgentError
from resilient.agent.warm import setup_line, spawn_zygote, take_early
from resilient.contract import PARENT_PID_ENV, SCRIPT_ENTRY

log = logging.getLogger(__name__)

# How long a fork request may wait for the zygote: it answers at once when
# ready, but a young zygote is still importing torch (up to ~30 s under load).
FORK_TIMEOUT = timedelta(minutes=5)

class WorkerProcess:
    """One child process: warm until :meth:`assign`, then a worker running
    ``entry.main(argv)`` (see :mod:`.warm`)."""

    def __init__(self, env: dict[str, str], entry: str = SCRIPT_ENTRY, preload: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient.agent.warm"],
            stdin=subprocess.PIPE, env={**os.environ, **env, PARENT_PID_ENV: str(os.getpid())},
            process_group=0,  # its own group: a kill reaches anything it started
        )
        self.proc.stdin.write(setup_line(preload))
        self.proc.stdin.flush()
        self.entry = entry
        self.born = time.monotonic()
        self.assigned = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def assign(self, env: dict[str, str], argv: list[str]) -> None:
        line = json.dumps({"env": env, "entry": self.entry, "argv": argv}) + "\n"
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


class Zygote:
    """A warm template process (``resilient.agent.warm --zygote``) that forks workers.

    The zygote reports on a pipe: ``ready``, ``started TOKEN PID`` and
    ``exit PID CODE``; a reader thread keeps what it says. Workers are the
    zygote's children, so their exit codes come from it, not from waitpid here.
    """

    def __init__(self, env: dict[str, str], started: tuple[subprocess.Popen, int] | None = None,
                 preload: tuple[str, ...] = ()):
        """``started``: a zygote already running (:func:`~.warm.start_early`, told its preload
        list there), else a new one that imports ``preload``."""
        self.proc, r = started if started is not None else spawn_zygote(env, preload)
        self._cv = threading.Condition()
        self.ready = False
        self.dead = False
        self._started: dict[str, int] = {}
        self.exits: dict[int, int] = {}
        self._tokens = 0
        self._reader = threading.Thread(target=self._read, args=(os.fdopen(r, "r"),), daemon=True,
                                        name=f"zygote-{self.proc.pid}")
        self._reader.start()

    def _read(self, pipe) -> None:
        with pipe:
            for line in pipe:
                what, *rest = line.split()
                with self._cv:
                    if what == "ready":
                        self.ready = True
                    elif what == "started":
                        self._started[rest[0]] = int(rest[1])
                    elif what == "exit":
                        self.exits[int(rest[0])] = int(rest[1])
                    self._cv.notify_all()
        with self._cv:
            self.dead = True
            self._cv.notify_all()

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def wait_ready(self, timeout: timedelta) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.ready or self.dead, timeout.total_seconds()) and self.ready

    def fork(self, env: dict[str, str], entry: str, argv: list[str], timeout: timedelta = FORK_TIMEOUT) -> int:
        """Start one worker running ``entry.main(argv)``; its pid."""
        with self._cv:
            self._tokens += 1
            token = f"{os.getpid()}-{self._tokens}"
        try:
            line = json.dumps({"env": env, "entry": entry, "argv": argv, "token": token}) + "\n"
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise AgentError(f"the warm zygote (pid {self.proc.pid}) is gone: {e}") from e
        with self._cv:
            if not self._cv.wait_for(lambda: token in self._started or self.dead, timeout.total_seconds()):
                raise AgentError(f"the warm zygote (pid {self.proc.pid}) did not fork a worker "
                                 f"within {timeout.total_seconds():.0f} s")
            if token not in self._started:
                raise AgentError(f"the warm zygote (pid {self.proc.pid}) died before forking a worker")
            return self._started.pop(token)

    def exit_code(self, pid: int) -> int | None:
        with self._cv:
            if pid in self.exits:
                return self.exits[pid]
            if not self.dead:
                return None
        # The zygote died first: its children got SIGKILL (PDEATHSIG) and nobody reports them.
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return -signal.SIGKILL
        except PermissionError:
            return None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class ForkedWorker:
    """A worker forked by a :class:`Zygote`: the same interface as :class:`WorkerProcess`."""

    def __init__(self, zygote: Zygote, entry: str = SCRIPT_ENTRY):
        self.zygote = zygote
        self.entry = entry
        self._pid: int | None = None
        self.assigned = False

    @property
    def pid(self) -> int:
        return self._pid if self._pid is not None else -1

    def assign(self, env: dict[str, str], argv: list[str]) -> None:
        self._pid = self.zygote.fork(env, self.entry, argv)
        self.assigned = True

    def poll(self) -> int | None:
        return None if self._pid is None else self.zygote.exit_code(self._pid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self._pid is not None and self.poll() is None:
            try:
                os.killpg(self._pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout: timedelta) -> int | None:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            code = self.poll()
            if code is not None or self._pid is None or time.monotonic() >= deadline:
                return code
            time.sleep(0.01)

    def discard(self) -> None:
        self.kill()


def discard_early(early: tuple[subprocess.Popen, int]) -> None:
    """Kill an early zygote nobody will use (it may still be importing: no waiting for it)."""
    proc, status = early
    proc.kill()
    proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()
    os.close(status)


class WarmPool:
    """Warm processes for workers. Thread-safe.

    ``size > 0``: one :class:`Zygote` forks every worker (``size`` only says
    that spares are wanted). ``size == 0``: every worker is a cold
    :class:`WorkerProcess`. Every worker runs ``entry.main(argv)``, after the
    modules of ``preload`` were imported (see :mod:`.warm`)."""

    def __init__(self, size: int, env: dict[str, str], refill_delay: timedelta = timedelta(seconds=2),
                 entry: str = SCRIPT_ENTRY, preload: tuple[str, ...] = ()):
        self.size = size
        self.env = env
        self.entry = entry
        self.preload = tuple(preload)
        self.refill_delay = refill_delay
        self._idle: list[WorkerProcess] = []
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._timer: threading.Timer | None = None

    def fill(self, at_least: int = 0) -> None:
        """Have the zygote running (or, without one, ``at_least`` cold processes idle:
        the workers an agent is about to start, importing while it joins the rendezvous)."""
        with self._lock:
            if self._closed:
                return
            if self.size > 0:
                if self._zygote is None or not self._zygote.alive():
                    if self._zygote is not None:
                        log.warning("the warm zygote (pid %d) died; starting another", self._zygote.proc.pid)
                        self._zygote.close()
                    early = take_early()
                    if early is not None and early[0].poll() is not None:
                        discard_early(early)
                        early = None
                    self._zygote = Zygote(self.env, early, self.preload)
                return
            early = take_early()  # no spares after all: the early zygote is not needed
            if early is not None:
                discard_early(early)
            while len(self._idle) < at_least:
                self._idle.append(self._cold())

    def wait_ready(self, timeout: timedelta) -> bool:
        """Wait until the zygote has imported everything (True), or ``timeout``
        (False). Without spares there is nothing to wait for (True)."""
        with self._lock:
            zygote = self._zygote
        return zygote.wait_ready(timeout) if zygote is not None else True

    def take(self) -> tuple[WorkerProcess | ForkedWorker, bool]:
        """A process for a worker, and whether it is warm (its imports done)."""
        if self.size > 0:
            self.fill()
            with self._lock:
                if self._zygote is not None:
                    return ForkedWorker(self._zygote, self.entry), self._zygote.ready
        with self._lock:
            while self._idle:
                wp = self._idle.pop(0)
                if wp.poll() is None:
                    return wp, False  # prestarted at agent start: maybe still importing
            return self._cold(), False

    def _cold(self) -> WorkerProcess:
        return WorkerProcess(self.env, self.entry, self.preload)

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
            zygote, self._zygote = self._zygote, None
        for wp in idle:
            wp.discard()
        if zygote is not None:
            zygote.close()
