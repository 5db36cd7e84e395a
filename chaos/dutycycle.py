"""The SIGSTOP/SIGCONT duty cycle of :class:`~chaos.slow.SlowProcess`, in a process of its own.

Run as a script (``python dutycycle.py``, by path: it needs only the standard library and
psutil, however the chaos package was imported). It reads one JSON line on stdin::

    {"pids": [[pid, create_time], ...], "period": seconds, "off": seconds}

then says ``cycling`` on stdout once it has stopped them the first time and, until stdin reaches end of file (its parent closed it, or died), stops the
processes for ``off`` seconds of every ``period`` and continues them for the rest. At
the end it continues them all and prints one JSON line: ``stopped_seconds`` (the
wall time between each stop and its continue, by its own clock), ``cycles``,
``late_max`` (the largest delay of a cycle's start past its schedule) and
``realtime`` (whether it got a real-time priority).

Why a process, not a thread of the campaign runner: on a loaded host a thread
sharing the runner's interpreter woke late, and the processes ran on unstopped
for 40-60 ms every few hundred milliseconds (a 20 ms period, 2 busy loops beside
a 2x2 campaign on 2 cores); the fail-slow probe, which times 18 ms rounds and
keeps the fastest, then timed a round that fit in such a gap and found the
"slow" rank as fast as the others (CI failed the slow-rank campaign that way).
A real slow device is slow all the time; the injector must be too. Its own
process waits on nothing but its own clock, and where it may (root, or
CAP_SYS_NICE) it takes the lowest real-time priority, so that a loaded host
wakes it on time: it sleeps almost always, and sends two signals per period.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

import psutil


def _processes(pids: list[list[float]]) -> list[psutil.Process]:
    """The processes still alive that are the ones named (a pid reused since is not)."""
    procs = []
    for pid, created in pids:
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - created) < 1e-3:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _realtime() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(os.sched_get_priority_min(os.SCHED_FIFO)))
        return True
    except (AttributeError, OSError):   # not Linux, or not allowed: the default policy
        return False


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    procs = _processes(spec["pids"])
    period, off = float(spec["period"]), float(spec["off"])
    realtime = _realtime()
    stdin = sys.stdin.fileno()

    def ended(seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as stdin ends (the parent's word to stop)."""
        return bool(select.select([stdin], [], [], max(0.0, seconds))[0])

    stopped, cycles, late_max = 0.0, 0, 0.0
    nxt = time.monotonic()
    try:
        while True:
            t0 = time.monotonic()
            late_max = max(late_max, t0 - nxt)
            _signal(procs, signal.SIGSTOP)
            if cycles == 0:
                print("cycling", flush=True)   # the parent's inject() returns on this line
            done = ended(off)
            _signal(procs, signal.SIGCONT)
            stopped += time.monotonic() - t0
            cycles += 1
            if done:
                break
            nxt += period
            # after a late wake-up, do not try to catch up (that would run them unstopped)
            nxt = max(nxt, time.monotonic() - period)
            if ended(nxt - time.monotonic()):
                break
    finally:
        _signal(procs, signal.SIGCONT)
    print(json.dumps({"stopped_seconds": stopped, "cycles": cycles, "late_max": late_max, "realtime": realtime}),
          flush=True)


if __name__ == "__main__":
    main()
