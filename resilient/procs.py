"""Killing a process and everything it started, for launchers, harnesses and tests.

A process group is not enough: torch's elastic agent starts each worker in a
session of its own, and resilient's warm workers run in their own process
groups, so killing the leader's group alone would orphan them. This finds the
descendants first, then kills the group and each descendant, and reaps them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from datetime import timedelta

import psutil


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
