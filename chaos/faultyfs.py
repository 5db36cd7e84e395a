"""An fsspec filesystem that makes another one flaky: errors, latency, torn writes.

For tests and the chaos harness: wrap any filesystem and storage misbehaves
at seeded random rates, the way object stores and disks do in production::

    fs = FaultyFileSystem(fsspec.filesystem("file"), error_rate=0.2, torn_write_rate=0.1,
                          latency=timedelta(milliseconds=5), seed=1)

or by URL, chained (``faulty::file:///tmp/ck``, ``faulty::s3://bucket/ck``)
with the rates, or a shared :class:`FaultPlan`, as storage options
(``fsspec.url_to_fs(url, faulty={"plan": plan})``). A filesystem made from a
bare URL (no plan, no rates: what a worker's ``snapshot.durable_url =
"faulty::file:///..."`` gives) uses the process's plan, :func:`process_plan`,
which the chaos control channel flips at run time (:mod:`.hooks`). The
``faulty`` protocol is registered with fsspec by the package's
``fsspec.specs`` entry point, so any process can open such a URL.

Faults:
- ``error_rate``: an operation raises :class:`InjectedFault` (an ``OSError``,
  like a dropped connection) before touching the target;
- ``torn_write_rate``: a write stores only a prefix of its bytes, then raises
  (or, with ``silent_torn``, reports success: a lying disk);
- ``corrupt_read_rate``: a read returns the bytes with one bit flipped;
- ``latency``: every operation sleeps this long first.
``plan.injected`` counts what was done, for assertions.
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import fsspec
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem


class InjectedFault(OSError):
    """A fault injected by :class:`FaultyFileSystem` (transient, like a network error)."""


@dataclass
class FaultPlan:
    """What to inject; mutable at run time (a test or the chaos harness flips it).

    Shared by every filesystem built with it, so faults can be switched on
    and off for a filesystem that fsspec created from a URL."""

    error_rate: float = 0.0
    torn_write_rate: float = 0.0
    corrupt_read_rate: float = 0.0
    latency: timedelta = timedelta(0)
    silent_torn: bool = False
    seed: int = 0
    enabled: bool = True
    injected: Counter = field(default_factory=Counter)
    users: int = 0  # filesystems built on this plan (a plan nobody uses injects nothing)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str, str], None]] = []

    def count(self, what: str, path: str) -> None:
        """Record one injected fault and tell the listeners (``what``, ``path``)."""
        with self._lock:
            self.injected[what] += 1
            listeners = list(self._listeners)
        for fn in listeners:
            fn(what, path)

    def listen(self, fn: Callable[[str, str], None]) -> Callable[[], None]:
        """Call ``fn(what, path)`` on every injected fault; returns the unsubscribe."""
        with self._lock:
            self._listeners.append(fn)

        def stop() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)
        return stop

    def roll(self, rate: float) -> bool:
        if not self.enabled or rate <= 0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def randrange(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(max(n, 1))


_PROCESS_PLAN: FaultPlan | None = None
_PROCESS_LOCK = threading.Lock()


def process_plan() -> FaultPlan:
    """The plan of every filesystem this process built from a bare
    ``faulty::`` URL; nothing is injected until a test or the chaos control
    channel sets a rate."""
    global _PROCESS_PLAN
    with _PROCESS_LOCK:
        if _PROCESS_PLAN is None:
            _PROCESS_PLAN = FaultPlan(seed=os.getpid())
        return _PROCESS_PLAN


class FaultyFileSystem(ChainedFileSystem):
    protocol = ("faulty",)
    cachable = False

    def __init__(self, fs: AbstractFileSystem | None = None, *, plan: FaultPlan | None = None,
                 target_protocol: str | None = None, target_options: dict | None = None,
                 fo: str | None = None, **rates: Any):
        super().__init__()
        self.fs = fs if fs is not None else fsspec.filesystem(target_protocol or "file", **(target_options or {}))
        # Built from a bare URL (no filesystem, plan or rates given): the process's plan.
        self.plan = plan if plan is not None else FaultPlan(**rates) if rates or fs is not None else process_plan()
        self.plan.users += 1

    @property
    def injected(self) -> Counter:
        return self.plan.injected

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        for prefix in ("faulty://", "faulty::"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path

    # ------------------------------------------------------------ the faults
    def _before(self, op: str, path: str) -> None:
        if self.plan.enabled and self.plan.latency.total_seconds() > 0:
            time.sleep(self.plan.latency.total_seconds())
            self.plan.count("latency", path)
        if self.plan.roll(self.plan.error_rate):
            self.plan.count(f"error:{op}", path)
            raise InjectedFault(f"injected {op} error on {path}")

    def _commit_write(self, path: str, data: bytes) -> None:
        self._before("write", path)
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        if self.plan.roll(self.plan.torn_write_rate):
            cut = self.plan.randrange(len(data))
            self.plan.count("torn_write", path)
            self.fs.pipe_file(path, data[:cut])
            if not self.plan.silent_torn:
                raise InjectedFault(f"injected torn write on {path} ({cut} of {len(data)} bytes)")
            return
        self.fs.pipe_file(path, data)

    # ------------------------------------------------------------- delegation
    def _open(self, path: str, mode: str = "rb", **kwargs: Any):
        if "w" in mode or "a" in mode:
            self._before("open", path)
            return _FaultyWriter(self, path)
        return io.BytesIO(self.cat_file(path))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self._before("read", path)
        data = self.fs.cat_file(path, start=start, end=end, **kwargs)
        if data and self.plan.roll(self.plan.corrupt_read_rate):
            i, bit = self.plan.randrange(len(data)), self.plan.randrange(8)
            self.plan.count("corrupt_read", path)
            data = bytearray(data)
            data[i] ^= 1 << bit
            data = bytes(data)
        return data

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._commit_write(path, bytes(value))

    def ls(self, path: str, detail: bool = True, **kwargs: Any):
        self._before("ls", path)
        return self.fs.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict:
        self._before("info", path)
        return self.fs.info(path, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._before("exists", path)
        return self.fs.exists(path, **kwargs)

    def size(self, path: str) -> int:
        return self.info(path)["size"]

    def rm_file(self, path: str) -> None:
        self._before("rm", path)
        self.fs.rm_file(path)

    def rm(self, path: str, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._before("rm", path)
        self.fs.rm(path, recursive=recursive, maxdepth=maxdepth)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.fs.mkdir(path, create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.fs.makedirs(path, exist_ok=exist_ok)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._before("mv", path1)
        self.fs.mv(path1, path2, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path)


class _FaultyWriter(io.BytesIO):
    """Buffers a write; on close the whole object is stored (or torn, or refused)."""

    def __init__(self, owner: FaultyFileSystem, path: str):
        super().__init__()
        self._owner, self._path, self._done = owner, path, False

    def close(self) -> None:
        if not self._done:
            self._done = True
            data = self.getvalue()
            super().close()
            self._owner._commit_write(self._path, data)
        else:
            super().close()


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
