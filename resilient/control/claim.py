"""One owner of a run dir's embedded etcd, taken atomically; every other agent finds it.

Why: ``resilient launch`` without ``--rdzv-endpoint`` runs an embedded etcd that the agents
of one run dir share. It used to look for ``RUN_DIR/etcd.endpoint`` and, when none
answered, start its own and write the file: check, then write. Two agents started
together (the README's own ``launch ... &`` three times), or a few seconds apart on a
loaded host, or over a file a ``kill -9`` left, each started an etcd, each waited in its
own for the other, and nothing was said until the join timeout (issue 38).

The claim, in ``RUN_DIR/control/`` (0700, :func:`resilient.rundir.private_dir`):

- ``owner.lock``: the owner holds an exclusive ``flock`` on it for its whole life. The
  kernel gives it to exactly one process, and drops it when that process dies, however
  (``kill -9`` included): no stale lock, and no second owner while the first lives. The fd
  is close-on-exec, so neither etcd nor a worker inherits it (the warm zygote is forked
  before the claim is taken).
- ``etcd.json``: the owner's record (endpoint, pid and its start ticks, host), sealed with
  a MAC under the job secret (:meth:`resilient.secret.JobSecret.seal_record`) and written
  aside then renamed into place, while holding the lock, once its etcd answers.

Every agent tries the lock first. The one that gets it owns the run dir's etcd, whatever a
record left by a dead owner says (it is stale: its owner's lock is gone), and overwrites
that record. The others read the record: one that authenticates and names a live process
(the pid, with the same start ticks) on this host is the endpoint; anything else (none
yet, its owner's etcd still starting, a stale one the new owner has not replaced yet) is
waited for, bounded (:class:`~resilient.control.api.ClaimSettings`), with a progress line,
and retried from the lock (an owner that failed and left frees it: the next one takes
over). So all agents of a run dir end on one endpoint, in any start order.

A record that fails its MAC and names a live process is refused (:class:`ClaimForged`):
the agent that wrote it has another job secret (or someone forged it), and joining would
split the job. One that names a dead process is stale, whoever wrote it, and is ignored.
A flock on a network file system is only as good as its lock manager: a run dir per
machine, or ``--rdzv-endpoint``, is the multi-machine way (and a record of another host
is refused: :class:`ClaimElsewhere`, the embedded etcd listens on loopback).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from resilient.control.api import (ClaimElsewhere, ClaimForged, ClaimSettings, ClaimTimeout, OwnerRecord)
from resilient.procs import process_alive, start_ticks
from resilient.rundir import open_private, private_dir, write_private
from resilient.secret import Unauthentic

__all__ = ["RunDirClaim", "control_dir", "read_owner", "CONTROL_DIR", "RECORD", "LOCK"]

CONTROL_DIR = "control"
LOCK = "owner.lock"
RECORD = "etcd.json"
PURPOSE = "control-plane"           # the MAC's purpose: a record of no other kind passes as this one
RECORD_KEY = f"{CONTROL_DIR}/{RECORD}"


def control_dir(run_dir: str | os.PathLike) -> Path:
    """``RUN_DIR/control``, created 0700 (narrowed if wider), never through a link."""
    return private_dir(Path(run_dir) / CONTROL_DIR, what="control dir", narrow=True)


def _say(line: str) -> None:
    print(f"resilient: {line}", file=sys.stderr, flush=True)


def lock_holders(path: Path) -> list[int]:
    """The pids holding a lock on ``path`` (``/proc/locks``), for messages; [] when unknown."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter has "->" after the id)
        parts = [p for p in parts if p != "->"]
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            try:
                pids.append(int(parts[4]))
            except ValueError:
                pass
    return pids


class RunDirClaim:
    """The claim on ``run_dir``'s control plane of one agent (module doc): :meth:`join` says
    whether it owns it (then :meth:`publish`, and :meth:`release` at the end) or who does."""

    def __init__(self, run_dir: str | os.PathLike, secret, settings: ClaimSettings = ClaimSettings(),
                 say: Callable[[str], None] = _say) -> None:
        self.run_dir = Path(run_dir)
        self.dir = control_dir(run_dir)
        self.secret, self.settings, self.say = secret, settings, say
        self.lock_path, self.record_path = self.dir / LOCK, self.dir / RECORD
        self.host = socket.gethostname()
        self._fd: int | None = None

    @property
    def owned(self) -> bool:
        return self._fd is not None

    # ------------------------------------------------------------ owner
    def try_own(self) -> bool:
        """Take the lock if nobody holds it (never blocks)."""
        if self._fd is not None:
            return True
        fd = open_private(self.lock_path, os.O_RDWR | os.O_CREAT, what="control plane lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._fd = fd
        return True

    def publish(self, endpoint: str) -> OwnerRecord:
        """Name our etcd in the record (owner only), atomically."""
        if self._fd is None:
            raise RuntimeError("publish() without the claim: join() did not make this agent the owner")
        me = os.getpid()
        record = OwnerRecord(endpoint, me, start_ticks(me), self.host)
        write_private(self.record_path, self.secret.seal_record(PURPOSE, RECORD_KEY, record.doc()), fsync=True)
        return record

    def release(self) -> None:
        """Remove our record, then the lock (in that order: no one reads our record as live
        once we let go). Idempotent; a no-op for an agent that did not own the claim."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.record_path.unlink(missing_ok=True)
        finally:
            os.close(fd)   # drops the flock

    # ------------------------------------------------------------ everyone
    def read(self) -> OwnerRecord | None:
        """The record if it authenticates and its owner lives on this host; None when there is
        none or it is stale. :class:`ClaimForged` for a live one under another secret;
        :class:`ClaimElsewhere` for a live one of another host."""
        try:
            fd = open_private(self.record_path, os.O_RDONLY, what="control plane record")
        except FileNotFoundError:
            return None
        try:
            raw = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        try:
            record = OwnerRecord.of(self.secret.open_record(PURPOSE, RECORD_KEY, raw))
        except Unauthentic as e:
            claimed = _unverified(raw)
            if claimed is None or not process_alive(*claimed):
                return None   # stale, whoever wrote it: the lock decides who owns now
            raise ClaimForged(
                f"the owner record of this run dir's embedded etcd ({self.record_path}) names a live process "
                f"(pid {claimed[0]}) but was not written with this node's job secret (fingerprint "
                f"{self.secret.fingerprint}): the agent that owns this run dir has another secret, or the record "
                f"was forged. Give every agent of the run dir the same secret (by default {self.run_dir}/job.secret; "
                f"--secret-file), or another --run-dir. ({e})") from None
        except (KeyError, ValueError, TypeError):
            return None
        if record.host != self.host:
            raise ClaimElsewhere(
                f"this run dir's embedded etcd ({record.endpoint}) is owned by agent pid {record.pid} on host "
                f"{record.host!r}, not this one ({self.host!r}): an embedded etcd serves one machine (it listens "
                f"on loopback). On several machines, run an etcd cluster and pass --rdzv-endpoint to every node, "
                f"or give each machine its own --run-dir")
        return record if process_alive(record.pid, record.pid_ticks) else None

    def join(self) -> OwnerRecord | None:
        """None: this agent now owns the control plane (the lock is held: start etcd, then
        :meth:`publish`). Else the live owner's record. Waits at most ``settings.wait`` for an
        owner that holds the lock to publish (:class:`ClaimTimeout`), saying so every
        ``settings.progress_every``."""
        start = time.monotonic()
        deadline = start + self.settings.wait.total_seconds()
        next_say = start + self.settings.progress_every.total_seconds()
        while True:
            if self.try_own():
                return None
            record = self.read()
            if record is not None:
                return record
            now = time.monotonic()
            if now >= deadline:
                holders = lock_holders(self.lock_path)
                who = f"process(es) {', '.join(map(str, holders))}" if holders else "another process"
                raise ClaimTimeout(
                    f"{who} hold(s) this run dir's control plane ({self.lock_path}) but published no live etcd "
                    f"endpoint in {self.settings.wait.total_seconds():.0f} s (its etcd did not start, or it is "
                    f"stopped). Check that process (`ps -o pid,stat,args -p {holders[0] if holders else 'PID'}`); "
                    f"if it is not an agent of this run, stop it, then launch this node again")
            if now >= next_say:
                holders = lock_holders(self.lock_path)
                self.say(f"waiting for the embedded etcd of run dir {self.run_dir}: "
                         f"{'agent pid ' + str(holders[0]) if holders else 'another agent'} owns it and has not "
                         f"published its endpoint yet ({now - start:.0f} s of at most "
                         f"{self.settings.wait.total_seconds():.0f} s)")
                next_say = now + self.settings.progress_every.total_seconds()
            time.sleep(self.settings.poll.total_seconds())


def _unverified(raw: bytes) -> tuple[int, int | None] | None:
    """The (pid, ticks) a record claims, unchecked: only to tell a stale record from a live one."""
    try:
        doc = json.loads(raw)
        ticks = doc.get("pid_ticks")
        return int(doc["pid"]), None if ticks is None else int(ticks)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_owner(run_dir: str | os.PathLike, secret) -> OwnerRecord | None:
    """For the tools of a run dir (``resilient status``, ``resilient quarantine``): the live
    owner of its embedded etcd, checked as :meth:`RunDirClaim.read` does; None when no agent
    of the run dir owns one (or the run dir has no control dir)."""
    if not os.path.isdir(Path(run_dir) / CONTROL_DIR):
        return None
    return RunDirClaim(run_dir, secret).read()


def peek_owner(run_dir: str | os.PathLike) -> OwnerRecord | None:
    """The record's claims without the secret (not authenticated: for a message, never to
    connect with), when its process is alive; None otherwise."""
    try:
        raw = (Path(run_dir) / CONTROL_DIR / RECORD).read_bytes()
        record = OwnerRecord.of(json.loads(raw))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if process_alive(record.pid, record.pid_ticks) else None
