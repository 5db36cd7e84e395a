"""Run a command in a private mount namespace with a few mounts changed (tests only).

Why: the fresh-machine tests need conditions this machine does not have: no
etcd anywhere, a 64 MB ``/dev/shm`` as in a container. A private mount
namespace (``unshare -m``, as root) changes what one command tree sees and
nothing else: other tests running in parallel keep the real ``/usr/bin/etcd``
and ``/dev/shm``, and the mounts vanish with the last process in the namespace.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import psutil

from resilient.procs import kill_tree


def namespace_unavailable() -> str | None:
    """Why a private mount namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "a private mount namespace needs root (euid is not 0)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -m is not permitted here: {probe.stderr.strip()}"
    return None


def in_namespace(argv: Sequence[str], *, hide: Sequence[Path | str] = (), tmpfs: dict[str, str] | None = None,
                 blank: Path) -> list[str]:
    """``argv`` wrapped to run in a new private mount namespace where each path in ``hide`` is
    covered by ``blank`` (an empty, non-executable file: a binary is gone, as far as PATH
    lookups and ``os.access`` can tell) and each ``tmpfs`` mount point (path → size, e.g.
    ``{"/dev/shm": "1m"}``) is a fresh tmpfs of that size."""
    steps = [f"mount --bind {shlex.quote(str(blank))} {shlex.quote(str(p))}" for p in hide]
    steps += [f"mount -t tmpfs -o size={shlex.quote(size)},mode=1777 tmpfs {shlex.quote(point)}"
              for point, size in (tmpfs or {}).items()]
    script = " && ".join([*steps, 'exec "$@"'])
    return ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", script, "sh", *argv]


def etcds_on_path() -> list[Path]:
    """Every ``etcd`` on PATH, resolved (``/bin/etcd`` and ``/usr/bin/etcd`` are one file on
    a merged-usr system), scripts included: pip's console script, pyenv's shim."""
    found = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = Path(d or ".") / "etcd"
        if p.is_file():
            real = p.resolve()
            if real not in found:
                found.append(real)
    return found


def blank_file(directory: Path) -> Path:
    """An empty file with mode 0644, to bind-mount over a binary."""
    blank = directory / "blank"
    blank.write_bytes(b"")
    blank.chmod(0o644)
    return blank


def session_members(sid: int) -> list[psutil.Process]:
    """Live processes of session ``sid`` (zombies are gone for our purpose)."""
    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def run_isolated(argv: Sequence[str], cwd: Path, timeout: timedelta = timedelta(seconds=150),
                 linger: timedelta = timedelta(seconds=10)) -> subprocess.CompletedProcess:
    """Run ``argv`` in a session of its own, stdout and stderr together in ``.stdout``.

    On timeout the whole tree is killed and the test fails. After it exits, processes it
    left in its session are waited for up to ``linger`` (a child dying with its parent
    takes a moment), then killed; their command lines are in ``.leftover``: a command
    that says it started nothing must leave none."""
    proc = subprocess.Popen(list(argv), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, _ = proc.communicate(timeout=timeout.total_seconds())
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{list(argv)[-12:]} ran past {timeout}:\n{out[-4000:]}") from None
    deadline = time.monotonic() + linger.total_seconds()
    left = session_members(proc.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = session_members(proc.pid)
    leftover = []
    for p in left:
        try:
            leftover.append(" ".join(p.cmdline()))
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    result = subprocess.CompletedProcess(list(argv), proc.returncode, out, "")
    result.leftover = leftover  # type: ignore[attr-defined]
    return result
