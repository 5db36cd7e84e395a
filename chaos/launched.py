"""One launched node: the job runner the tests, the benchmarks and the chaos harness share.

A node of a simulated multi-node job is a launcher process (``resilient launch``, or
``torchrun`` for the anchors' rows) in a session of its own, its output in a log file,
so that the whole node (launcher, workers, their children) can be killed at once, as a
lost machine is, and whatever happens, nothing it started outlives the test, row or
campaign that started it. :class:`LaunchedNode` is that handle; :func:`launch_argv`
spells the command line; :func:`run_events` and :func:`wait_for` are how every caller
watches a run from outside (its event log, never what the caller assumes).

Above the runtime (``resilient/`` never imports it), beside the chaos harness's own job
machinery (:mod:`.jobs`, whose :class:`~.jobs.LocalJob` runs its agents through it) and
the real-etcd fixtures (:mod:`.etcd_testing`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Callable, Iterable

from resilient.contract import events_path
from resilient.events import read_events
from resilient.procs import kill_tree

__all__ = ["REPO", "LaunchedNode", "WaitTimedOut", "launch_argv", "run_events", "wait_for"]

REPO = Path(__file__).resolve().parent.parent
REAP = timedelta(seconds=10)


class WaitTimedOut(AssertionError, TimeoutError):
    """A wait on a job ran out: a test's failure (AssertionError) and a benchmark's
    timeout (TimeoutError) alike, so either may catch it and say what the job did."""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns a truthy value, and return it; after ``timeout``
    seconds, :class:`WaitTimedOut` naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise WaitTimedOut(f"timed out after {timeout}s waiting for {what}")


def run_events(run_dir: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """The events of a run dir's log so far (of one kind); a line still being written, or
    torn by a killed writer, is left out."""
    path = events_path(Path(run_dir))
    evs = list(read_events(path)) if path.exists() else []
    return [e for e in evs if kind is None or e["event"] == kind]


def launch_argv(target: str | os.PathLike, run_dir: Path, *, node_id: str | None = None, nnodes: str | None = None,
                endpoint: str | None = None, nproc: int | None = None, overrides: Iterable[str] = (),
                extra_args: Iterable[str] = (), script_args: Iterable[str] = ()) -> list[str]:
    """``resilient launch``'s command line: options first, then ``target`` (a GPT run config,
    or a script and its ``script_args``), as for torchrun."""
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--run-dir", str(run_dir)]
    if node_id is not None:
        cmd += ["--node-id", node_id]
    if nnodes is not None:
        cmd += ["--nnodes", nnodes]
    if endpoint:
        cmd += ["--rdzv-endpoint", endpoint]
    if nproc:
        cmd += ["--nproc-per-node", str(nproc)]
    for o in overrides:
        cmd += ["--set", o]
    return [*cmd, *extra_args, str(target), *script_args]


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the thread that started it dies, even by
    SIGKILL (Linux PR_SET_PDEATHSIG), so a killed campaign leaves no job behind (the agent
    then stops its workers and removes its node store)."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class LaunchedNode:
    """A launcher process in a session of its own, its stdout and stderr in ``log``.

    ``term_with_parent``: SIGTERM it if this process dies first (a campaign killed mid-way).
    Use as a context manager, or call :meth:`close`: the node's whole tree is killed."""

    def __init__(self, cmd: list[str], log: Path, *, env: dict[str, str] | None = None,
                 term_with_parent: bool = False, cwd: Path = REPO) -> None:
        self.cmd, self.log_path = cmd, Path(log)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = open(self.log_path, "w+")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     preexec_fn=_term_with_parent if term_with_parent else None)
        self.started = time.time()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """Everything it printed so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 3000) -> str:
        return self.output()[-n:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        """Its exit code; :class:`WaitTimedOut` with its last output if it runs past ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise WaitTimedOut(f"{Path(self.cmd[0]).name} {' '.join(self.cmd[1:5])} … still running after "
                               f"{timeout}s:\n{self.tail()}") from None

    def terminate(self) -> None:
        """SIGTERM the launcher (a preemption: an agent stops its workers and leaves)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def kill(self, reap: timedelta = REAP) -> float:
        """kill -9 the launcher, its process group and every descendant at once (torchrun puts
        its workers in sessions of their own: the group alone is not enough): a whole node lost.
        Returns the time of the kill. Of a launcher already exited, only its group is killed
        (orphans stay in it; its pid, reaped, may name another process now)."""
        t = time.time()
        if self.proc.poll() is None:
            kill_tree(self.proc, reap)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return t

    def close(self) -> None:
        """Kill whatever is left of the node, and close its log."""
        self.kill()
        self._log.close()

    def __enter__(self) -> "LaunchedNode":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

