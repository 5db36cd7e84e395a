"""Killing a process and everything it started, for launchers, harnesses and tests;
and owner files, which let the next process reclaim what a killed one left behind.

A process group is not enough: torch's elastic agent starts each worker in a
session of its own, and resilient's warm workers run in their own process
groups, so killing the leader's group alone would orphan them. This finds the
descendants first, then kills the group and each descendant, and reaps them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from typing import NoReturn

import psutil


OWNER = "owner.json"


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``), or None
    off Linux. Exact and free of the wall clock, unlike ``psutil``'s ``create_time``: that is
    the boot time plus these ticks, and the boot time (``btime``, whole seconds, the wall clock
    minus the uptime) moves by a second whenever the wall clock drifts or is stepped past a
    second's edge. A process that started after such a move saw every live owner 1 s off,
    judged them dead, and reclaimed their trees (the soak: three live agents' private
    directories and node stores removed by a replacement agent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:   # field 22; the command name (field 2, in parentheses) may hold spaces
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def owner_record(**extra) -> str:
    """This process as an owner file's content: its pid and when it started (a pid alone
    can be reused by another process)."""
    me = psutil.Process()
    return json.dumps({"pid": me.pid, "pid_started": me.create_time(), "pid_ticks": start_ticks(me.pid), **extra})


def process_alive(pid: int, ticks: int | None = None) -> bool:
    """Is ``pid`` a running process (of any user) and, when ``ticks`` is given, the same one
    that started at those ticks (a pid alone can be reused)?"""
    if ticks is not None:
        return start_ticks(pid) == ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_alive(directory: str | os.PathLike) -> bool:
    """Is the process named by ``directory/owner.json`` still running? False when the file
    is missing or unreadable, or the pid now belongs to another process."""
    try:
        with open(os.path.join(directory, OWNER)) as f:
            info = json.load(f)
        pid = int(info["pid"])
        if isinstance(info.get("pid_ticks"), int):
            return process_alive(pid, info["pid_ticks"])
        proc = psutil.Process(pid)
        return abs(proc.create_time() - float(info["pid_started"])) < 1.0
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False


def exit_without_teardown(code: int) -> NoReturn:
    """End this process as the interpreter would, less its teardown of every module.

    Why: a process that imported torch spends 1.5 s of CPU at exit tearing its modules down
    and collecting their objects (measured: ``import torch, resilient.job, torch._dynamo``
    then exit, 1.5-1.6 s more CPU than the same with this), and the launcher waits for it
    twice at every run's end: its zygote's exit, then its own. What an exit must do still
    happens, in the interpreter's order: the threading module's exit hooks and the join of
    non-daemon threads, the ``atexit`` functions (logging's flush among them), stdout and
    stderr flushed; then ``os._exit``. Only for processes whose own code closes what they
    opened (the launcher, the zygote), never one that ran a user's script, whose files
    may wait for the teardown to be flushed."""
    shutdown = getattr(threading, "_shutdown", None)   # CPython's first step of Py_Finalize
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):   # closed, or a broken pipe: nothing to keep
            pass
    os._exit(code if isinstance(code, int) else 1)


def ignore_stop_signals() -> None:
    """Ignore SIGINT and SIGTERM from now on: a graceful stop (bounded by its own grace)
    that a second Ctrl-C cut short would leave processes behind."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except ValueError:  # not the main thread: no handler of ours is installed there
            pass


def reclaim_dirs(parent: str | os.PathLike, prefix: str,
                 grace: timedelta | None = timedelta(hours=1)) -> list[str]:
    """Remove the ``prefix*`` directories under ``parent`` whose owner process is gone (one
    killed with -9 cannot remove its own). One without an owner file is removed only once
    older than ``grace`` (it may be a moment from getting one), never with ``grace=None``.
    Returns what was removed."""
    import shutil
    import time

    removed = []
    for entry in os.scandir(parent):
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        has_owner = os.path.exists(os.path.join(entry.path, OWNER))
        if not has_owner and grace is None:
            continue
        try:
            stale = (not owner_alive(entry.path)) if has_owner else (
                time.time() - entry.stat(follow_symlinks=False).st_mtime > grace.total_seconds())
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def kill_tree(proc: subprocess.Popen, timeout: timedelta = timedelta(seconds=10)) -> None:
    """SIGKILL ``proc`` (started with its own session or group), its group and
    every descendant; wait up to ``timeout`` for them to be gone."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    # Even if the leader exited, orphans may remain in its group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout.total_seconds())
    psutil.wait_procs(descendants, timeout=timeout.total_seconds())
