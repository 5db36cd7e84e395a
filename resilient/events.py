"""The JSON-lines event log every resilient process writes.

Each process appends to ``RUN_DIR/events.jsonl`` one JSON object per line.
Every object carries ``time`` (UNIX seconds, float), ``event`` (a name from
:data:`EVENTS`), ``node`` (the node id) and ``rank`` (global rank, or -1 for an
agent or tool). The fields of each event kind are documented in
``docs/events.md``; :data:`EVENTS` is the list of kinds, and writing an unknown
kind is a bug (it raises), so the schema page stays true.

Lines are appended with a single ``write`` on a file opened ``O_APPEND``, so
several processes on one node can share the file without tearing lines. The file
is the job user's alone (mode 0600, :func:`resilient.rundir.open_private`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from resilient.contract import EVENTS_FILE, NODE_ID_ENV, RUN_DIR_ENV, events_path
from resilient.rundir import open_private

# Event kinds, grouped by who writes them. docs/events.md describes each.
EVENTS = frozenset({
    # worker
    "run_start", "step", "eval", "run_end", "worker_error",
    # snapshots
    "snapshot", "commit", "upload", "upload_error", "restore", "restore_fallback", "gc", "store_full", "store_adopted",
    "snapshot_interval",
    # agent and rendezvous
    "agent_start", "agent_stop", "rendezvous", "workers_started", "failure",
    "heartbeat_timeout", "evicted", "preemption", "scale", "membership", "auth_failure", "metrics",
    # silent data corruption
    "sdc_suspect", "sdc_replay", "sdc_cross_check", "sdc_gemm_check", "sdc_verdict", "sdc_probe", "sdc_coverage", "quarantine", "rollback",
    # fail-slow
    "straggler", "failslow_probe", "failslow_replace", "failslow_mark", "failslow_rejoin",
    # chaos
    "fault_injected", "fault_cleared",
})


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/inf; keep them readable
    return value


class EventLog:
    """Append-only writer of one process's events.

    ``node`` and ``rank`` are stamped on every event. A log with ``path=None``
    drops events (a library user who wants none).
    """

    def __init__(self, path: str | os.PathLike | None, node: str | None = None, rank: int = -1):
        self.path = Path(path) if path else None
        self.node = node or socket.gethostname()
        self.rank = rank
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # 0600 whatever the umask, never through a link: a run's events are its user's alone
            self._fd = open_private(self.path, what="event log")

    def emit(self, event: str, **fields: Any) -> dict:
        if event not in EVENTS:
            raise ValueError(f"unknown event kind {event!r}; add it to resilient.events.EVENTS and docs/events.md")
        record = {"time": time.time(), "event": event, "node": self.node, "rank": self.rank}
        record.update({k: _jsonable(v) for k, v in fields.items()})
        if self._fd is not None:
            os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def emit(events: "EventLog | None", kind: str, **fields: Any) -> None:
    """``events.emit(kind, ...)`` where a component may run without an event log (None)."""
    if events is not None:
        events.emit(kind, **fields)


def read_events(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the events of a log, skipping a torn last line (a killed writer)."""
    with open(path, "rb") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def merge_events(paths: list[str | os.PathLike]) -> list[dict]:
    """Merge several logs into one timeline ordered by time."""
    merged = [e for p in paths if os.path.exists(p) for e in read_events(p)]
    merged.sort(key=lambda e: e.get("time", 0.0))
    return merged


LOG_PATTERNS = (EVENTS_FILE, f"*/{EVENTS_FILE}", f"*/*/{EVENTS_FILE}")   # a run dir's logs, not its checkpoint trees


class EventTail:
    """Incremental reader of every event log under a run directory (up to three levels
    deep, so checkpoint trees are not walked): :meth:`poll` returns the complete lines
    appended since the last call, oldest first. A line still being written waits for the
    next call; a torn line (its writer killed mid-write) is skipped. Used by whatever
    watches a live run: ``resilient status``, the chaos harness's fault driver."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}

    def paths(self) -> list[Path]:
        return sorted({p for pattern in LOG_PATTERNS for p in self.run_dir.glob(pattern)})

    def poll(self) -> list[dict]:
        new: list[dict] = []
        for path in self.paths():
            off = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(off)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(e, dict) and isinstance(e.get("time"), (int, float)):
                    new.append(e)
            self._offsets[path] = off + end
        new.sort(key=lambda e: e["time"])
        return new


def record_worker_error(error: BaseException, text: str, run_dir: str | os.PathLike | None = None,
                        node: str | None = None) -> None:
    """A worker program's uncaught error as the ``worker_error`` event its agent quotes when it
    gives up (``text``: the traceback as printed). ``run_dir``/``node`` default to what the
    agent told the worker (:mod:`resilient.contract`); not under an agent, nothing is written."""
    run_dir = run_dir or os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return  # not under resilient launch: the traceback on stderr is all there is
    try:
        EventLog(events_path(run_dir), node=node or os.environ.get(NODE_ID_ENV),
                 rank=int(os.environ.get("RANK", "-1"))).emit(
            "worker_error", error=f"{type(error).__name__}: {error}", traceback=text)
    except OSError as log_error:  # the traceback is on stderr anyway
        print(f"resilient: could not record the worker_error event: {log_error}", file=sys.stderr)
