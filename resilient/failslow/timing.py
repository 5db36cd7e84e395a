"""Per-rank step timing, cheap: where each step's wall time went on this rank.

Two clocks, both monotonic and both free of new collectives:

- :class:`CollectiveClock` counts the time the training thread spends blocked
  in ``Work.wait()``: every synchronous ``torch.distributed`` collective waits
  there (``all_reduce`` without ``async_op`` calls it), and so do FSDP2's
  all-gathers and reduce-scatters, the SDC checks' exchanges and the job's own
  step-boundary all-reduce. A plain loop gets its "waiting for the others"
  split out with no code change. Not seen: waits inside C++ (DDP's reducer
  finishes its buckets there) and, on CUDA, the time a NCCL kernel waits on
  the device (``Work.wait`` only orders streams): there the wait shows up as
  compute, and a loop can mark it itself with ``job.phase("wait")``.
- :class:`StepTimer` splits a step interval into ``compute``, ``wait``,
  ``data`` and ``snapshot`` (:data:`~resilient.failslow.api.PHASES`);
  ``phase(name)`` marks a region (``job.phase("data")`` around the loader),
  collectives inside it still count as waiting.

Both also read run-queue delay (``schedstat``: time runnable but waiting for a
CPU another process holds): on a shared host that is where most of the
step-to-step noise comes from, and it is not the rank's own slowness (the
detector keeps it apart; Linux only, 0 elsewhere). The step's is the largest
of the training thread's and the intra-op pool's threads' (:class:`ProcessRunDelay`):
a step also waits for its intra-op threads, and one of them kept off the CPU
stretches the step while the training thread, waiting for it, is not queued
at all (the training thread's alone gave 0-2 false ``device`` verdicts per ~100
clean steps with 2x2 workers x 2 threads on 2 cores). The process's other
threads are left out: gloo's, the store's and Python's own threads (snapshot
writers, heartbeats) run beside the step, not in it, and counting their delay
made a healthy rank's own time vanish on a loaded host. Inside a collective
wait it is the waiting thread's own (:class:`CollectiveClock`).

Cost: a Python wrapper and two ``perf_counter`` calls per ``Work.wait`` (~1 µs)
and a few per step; bench/failslow.py measures it against a step.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from resilient.failslow.api import FailSlowError

MARKABLE = ("data", "wait", "snapshot")


def open_run_delay() -> int | None:
    """An fd on this thread's schedstat, or None where there is none (not Linux)."""
    try:
        return os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return None


def run_delay(fd: int | None) -> float:
    """Seconds this thread has spent runnable but not running (0.0 without an fd)."""
    if fd is None:
        return 0.0
    try:
        return int(os.pread(fd, 64, 0).split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


class ProcessRunDelay:
    """Run-queue delay of the calling (training) thread and the intra-op pool's threads
    (``/proc/self/task/*/schedstat``): a counter that grows at each read by the largest
    increase of one of them since the last read. The largest, not the sum: a parallel
    region lasts as long as its most delayed thread, and an idle pool thread spinning
    after a region is runnable too (summed, its queueing made clean runs noisier: 1 false
    verdict in 7 clean 3-rank drills at load 3-9, none in 7 with the training thread's
    alone nor in 3 with the largest; too few runs to tell the last two apart).
    Never less than the training thread's own delay (the old correction).

    The pool's threads are the ones native code made without a name of their own (they
    carry the process's name, as OpenMP's do) and that are no Python thread; gloo's and
    the TCP store's threads name themselves. Listed again every ``relist`` reads (the pool
    is made at the first parallel region); each read is one ``pread`` per thread on fds
    kept open."""

    def __init__(self, relist: int = 64):
        self.relist = relist
        self.total = 0.0
        self._fds: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._reads = 0
        self._fallback = open_run_delay() if not os.path.isdir("/proc/self/task") else None

    def _list(self) -> None:
        me = threading.get_native_id()
        python = {t.native_id for t in threading.enumerate()} - {me}
        try:
            tids = set(os.listdir("/proc/self/task"))
            with open("/proc/self/comm") as f:
                name = f.read()
        except OSError:
            return
        for tid in tids - set(self._fds):
            if int(tid) != me and int(tid) in python:
                continue
            try:
                if int(tid) != me:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        if f.read() != name:
                            continue   # a thread that named itself: gloo's, the store's
                self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue   # it ended meanwhile

    def read(self) -> float:
        """Seconds of run-queue delay so far: each interval's most delayed step thread's."""
        if self._fallback is not None:
            return run_delay(self._fallback)
        if self._reads % self.relist == 0:
            self._list()
        self._reads += 1
        most = 0
        for tid, fd in list(self._fds.items()):
            try:
                now = int(os.pread(fd, 64, 0).split()[1])
            except (OSError, IndexError, ValueError):   # the thread ended
                os.close(fd)
                del self._fds[tid]
                self._last.pop(tid, None)
                continue
            most = max(most, now - self._last.get(tid, now))
            self._last[tid] = now
        self.total += most * 1e-9
        return self.total

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._fallback is not None:
            os.close(self._fallback)
            self._fallback = None


class CollectiveClock:
    """Seconds the owning thread spent in ``torch.distributed.Work.wait`` (see the module doc).

    Installed by patching the method on the Work class once per process (shared by
    every clock, reference-counted); only waits on the thread that made the clock
    count (a snapshot writer thread's waits are not the training loop's)."""

    _lock = threading.Lock()
    _clocks: list["CollectiveClock"] = []
    # the Work class's own ``wait`` attribute while patched: kept in a list, since as a class
    # attribute here pybind's method descriptor would bind to this class when read back
    _saved: list = []

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.total = 0.0
        self.queued = 0.0        # run-queue delay during those waits (not the rank's own time either)
        self.calls = 0
        self.fd = open_run_delay()
        self._installed = False

    def install(self) -> "CollectiveClock":
        import torch.distributed as dist

        with CollectiveClock._lock:
            if not CollectiveClock._saved:
                original = dist.Work.wait
                # the class's own attribute (pybind's method descriptor) is what goes back: the
                # function read through the class no longer binds ``self``
                CollectiveClock._saved.append(dist.Work.__dict__["wait"])
                clocks = CollectiveClock._clocks

                def timed_wait(work, *args, **kwargs):
                    if not clocks:
                        return original(work, *args, **kwargs)
                    me = threading.get_ident()
                    mine = [c for c in clocks if c.thread == me]
                    if not mine:
                        return original(work, *args, **kwargs)
                    t0, q0 = time.perf_counter(), run_delay(mine[0].fd)
                    try:
                        return original(work, *args, **kwargs)
                    finally:
                        spent, queued = time.perf_counter() - t0, run_delay(mine[0].fd) - q0
                        for clock in mine:
                            clock.total += spent
                            clock.queued += queued
                            clock.calls += 1

                timed_wait.__doc__ = original.__doc__
                dist.Work.wait = timed_wait
            CollectiveClock._clocks.append(self)
            self._installed = True
        return self

    def uninstall(self) -> None:
        import torch.distributed as dist

        with CollectiveClock._lock:
            if not self._installed:
                return
            self._installed = False
            CollectiveClock._clocks.remove(self)
            if not CollectiveClock._clocks and CollectiveClock._saved:
                dist.Work.wait = CollectiveClock._saved.pop()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StepTimer:
    """The phases of the current step interval on this rank (see the module doc)."""

    def __init__(self, clock: CollectiveClock | None, queued: bool = True):
        """``queued``: read the run-queue delay at each lap (off when nothing judges the
        timings: a ``pread`` per step thread per step, for nobody)."""
        self.clock = clock
        self._marked = {p: 0.0 for p in MARKABLE}
        self._delay = ProcessRunDelay() if queued else None
        self._t0 = time.perf_counter()
        self._wait0 = self._waited()
        self._queued0 = self._queued()
        self._qwait0 = self._queued_waiting()
        self._inside: str | None = None

    def _waited(self) -> float:
        return self.clock.total if self.clock is not None else 0.0

    def _queued(self) -> float:
        """Run-queue delay of the process's threads so far (inside collective waits or not)."""
        return self._delay.read() if self._delay is not None else 0.0

    def _queued_waiting(self) -> float:
        return self.clock.queued if self.clock is not None else 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside as ``name`` (data, wait or snapshot); collectives inside
        a data or snapshot phase still count as waiting. Phases do not nest."""
        if name not in MARKABLE:
            raise FailSlowError(f"job.phase({name!r}): the phases a loop can mark are {', '.join(MARKABLE)}; "
                                "compute is what is left of the step")
        if self._inside is not None:
            raise FailSlowError(f"job.phase({name!r}) inside job.phase({self._inside!r}): phases do not nest; "
                                "close the outer one first")
        self._inside = name
        t0, w0 = time.perf_counter(), self._waited()
        try:
            yield
        finally:
            self._inside = None
            spent = time.perf_counter() - t0
            waited = self._waited() - w0
            if name == "wait":   # a collective timed twice (the clock and the mark) counts once
                self._marked["wait"] += max(0.0, spent - waited)
            else:
                self._marked[name] += max(0.0, spent - waited)

    def close(self) -> None:
        if self._delay is not None:
            self._delay.close()

    def lap(self) -> list[float]:
        """The interval since the last lap as [compute, wait, data, snapshot, wall, queued]
        (seconds), and start the next interval. ``wait``: blocked in collectives, not
        counting the run-queue delay there (woken, but another process held the CPU);
        ``queued``: all the run-queue delay of the interval (every thread's: module doc;
        at most the interval's non-wait time), so ``wall - wait - queued``
        is what the rank itself needed, and ``wait`` what it waited for the others."""
        now, waited, queued, qwait = time.perf_counter(), self._waited(), self._queued(), self._queued_waiting()
        wall = now - self._t0
        q_in_wait = max(0.0, qwait - self._qwait0)
        wait = max(0.0, (waited - self._wait0) - q_in_wait) + self._marked["wait"]
        data, snapshot = self._marked["data"], self._marked["snapshot"]
        compute = max(0.0, wall - wait - data - snapshot)
        q = min(max(0.0, queued - self._queued0), compute + data + snapshot)
        self._t0, self._wait0, self._queued0, self._qwait0 = now, waited, queued, qwait
        self._marked = {p: 0.0 for p in MARKABLE}
        return [compute, wait, data, snapshot, wall, q]
