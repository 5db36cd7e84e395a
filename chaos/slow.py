"""Fail-slow injectors: make one rank or one host slow without stopping it.

:class:`SlowProcess` slows its targets by a SIGSTOP/SIGCONT duty cycle: in
every ``period`` the processes are stopped for ``period * (1 - 1/factor)``
and run for the rest, so whatever they compute takes ``factor`` times as long
(it works everywhere, unprivileged, on any CPU or GPU job: a stopped process
launches no kernels either). ``kind`` says what it stands for:

- ``slow-rank``: one worker (a throttled GPU, a thermally capped CPU);
- ``slow-host``: every worker of one agent (a noisy neighbour, a power cap);
- ``agent-stall`` (:class:`AgentStall`): one agent, not its workers, stopped in bursts of
  seconds (a loaded host that does not schedule it): its lease lapses, it is not lost.

A slow link is :class:`~chaos.netns.PacketLoss` at a low rate on one node's
veth (TCP retransmits stretch every transfer through it) or the TCP proxy's
bandwidth limit: existing injectors, new kinds in :mod:`chaos.scenario`.

The effect is observed, not assumed: ``inject`` returns once the kernel shows
every target stopped in the first cycle, and the record's detail ends with
the duty cycle actually achieved (stopped share of the wall time, and the
slowdown factor it amounts to), measured by the injector's own clock. The cycle
runs in a process of its own (:mod:`chaos.dutycycle`, which says why), so that
a loaded host does not leave the targets running unstopped between its signals.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

from .injectors import DEFAULT_SETTLE, InjectionFailed, Injector, PidSource, _procs_of, _signal_all


CYCLER_START = timedelta(minutes=1)   # a Python start on a loaded host; the wait ends when it cycles


class SlowProcess(Injector):
    """Slow the target processes by ``factor`` (> 1) with a SIGSTOP/SIGCONT duty cycle
    of ``period``; ``tree``: the target's descendants (a node's workers), not the target
    itself (its agent keeps its lease and heartbeat checks running)."""

    kind = "slow-rank"

    def __init__(self, source: PidSource, *, factor: float, period: timedelta = timedelta(milliseconds=20),
                 tree: bool = False, settle: timedelta = DEFAULT_SETTLE, **kw: Any) -> None:
        super().__init__(**kw)
        if not factor > 1.0:
            raise InjectionFailed(f"slow-down factor {factor} must be > 1 (2.0 = everything takes twice as long)")
        if period <= timedelta(0):
            raise InjectionFailed(f"duty-cycle period {period} must be positive")
        self.source, self.factor, self.period, self.tree, self.settle = source, factor, period, tree, settle
        self.kind = "slow-host" if tree else "slow-rank"
        self.procs: list[psutil.Process] = []
        self.pids: list[int] = []
        self._cycler: subprocess.Popen | None = None
        self.stopped_seconds = 0.0
        self.started = self.ended = 0.0
        self.late_max, self.realtime = 0.0, False

    def _targets(self) -> list[psutil.Process]:
        procs = _procs_of(self.source, self.tree)
        return procs[1:] if self.tree and len(procs) > 1 else procs

    def _all_stopped(self) -> bool:
        for p in self.procs:
            try:
                if p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    def _any_stopped(self) -> bool:
        for p in self.procs:
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    return True
            except psutil.NoSuchProcess:
                pass
        return False

    def _inject(self) -> str:
        self.procs = self._targets()
        self.pids = [p.pid for p in self.procs]
        # the first cycle by hand: its stop must be seen in the kernel's process state
        _signal_all(self.procs, signal.SIGSTOP)
        deadline = time.monotonic() + self.settle.total_seconds()
        while not self._all_stopped():
            if time.monotonic() > deadline:
                _signal_all(self.procs, signal.SIGCONT)
                raise InjectionFailed(f"SIGSTOP sent but pids {self.pids} not all stopped within {self.settle}")
            time.sleep(0.001)
        _signal_all(self.procs, signal.SIGCONT)
        self._start_cycle()
        return (f"SIGSTOP/SIGCONT duty cycle on pids {self.pids}: stopped {1 - 1 / self.factor:.0%} of every "
                f"{self.period.total_seconds() * 1e3:.0f} ms (slow-down x{self.factor:g}); first stop observed")

    def _start_cycle(self) -> None:
        """The cycle runs in a process of its own (chaos/dutycycle.py says why), told what to
        stop on its stdin; closing that (or this process dying) ends it."""
        period = self.period.total_seconds()
        spec = {"pids": [[p.pid, p.create_time()] for p in self.procs if p.is_running()],
                "period": period, "off": period * (1.0 - 1.0 / self.factor)}
        self._cycler = subprocess.Popen([sys.executable, str(Path(__file__).with_name("dutycycle.py"))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._cycler.stdin is not None and self._cycler.stdout is not None
        self._cycler.stdin.write(json.dumps(spec) + "\n")
        self._cycler.stdin.flush()
        # Return only once it cycles: its interpreter takes a while to start on a loaded host,
        # and a probe run right after inject() must meet a slow process (CI: a probe taken
        # before the first cycle found the "slow" rank as fast as the others).
        ready = select.select([self._cycler.stdout], [], [], CYCLER_START.total_seconds())[0]
        if not ready or self._cycler.stdout.readline().strip() != "cycling":
            self._stop_cycle()
            _signal_all(self.procs, signal.SIGCONT)
            raise InjectionFailed(f"the duty cycle's process (chaos/dutycycle.py) did not start within {CYCLER_START}")
        self.started = time.monotonic()

    def _stop_cycle(self) -> None:
        cycler, self._cycler = self._cycler, None
        if cycler is None:
            return
        try:
            out, _ = cycler.communicate(input="", timeout=self.settle.total_seconds())
            report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        except (subprocess.TimeoutExpired, ValueError):
            cycler.kill()
            cycler.wait()
            report = {}
        self.ended = time.monotonic()
        self.stopped_seconds = float(report.get("stopped_seconds", self.stopped_seconds))
        self.late_max = float(report.get("late_max", 0.0))
        self.realtime = bool(report.get("realtime", False))

    @property
    def achieved_factor(self) -> float:
        """The slow-down the duty cycle achieved: wall / (wall - stopped), over the injection
        (known once it is cleared)."""
        if not self.started:
            return 1.0
        wall = (self.ended or time.monotonic()) - self.started
        return wall / max(1e-9, wall - self.stopped_seconds) if wall > 0 else 1.0

    def _clear(self) -> None:
        self._stop_cycle()
        _signal_all(self.procs, signal.SIGCONT)
        deadline = time.monotonic() + self.settle.total_seconds()
        while self._any_stopped():
            if time.monotonic() > deadline:
                raise InjectionFailed(f"SIGCONT sent but some of pids {self.pids} are still stopped")
            time.sleep(0.005)
        if self.record is not None:
            self.record.detail += (f"; achieved x{self.achieved_factor:.2f} over {self.ended - self.started:.1f} s"
                                   f" (a cycle late by {self.late_max * 1e3:.0f} ms at most"
                                   f"{', real-time priority' if self.realtime else ''})")


class AgentStall(SlowProcess):
    """Stall one node's agent (the process alone; its workers train on) in bursts: stopped for
    ``stall`` then running for ``run``, repeated until cleared. A loaded host does this to an
    agent (issue 38: 17-60 s stalls at load 45-160): a burst longer than the node lease lets the
    lease lapse, and the job must not declare the node lost, since its agent's pid is alive and
    its port accepts (no second signal) and the burst ends before ``launch.loss_confirm_bound``."""

    def __init__(self, source: PidSource, *, stall: timedelta, run: timedelta, settle: timedelta = DEFAULT_SETTLE,
                 **kw: Any) -> None:
        if stall <= timedelta(0) or run <= timedelta(0):
            raise InjectionFailed(f"agent-stall needs a positive stall ({stall}) and run ({run}) between bursts")
        period = stall + run
        super().__init__(source, factor=period / run, period=period, tree=False, settle=settle, **kw)
        self.kind = "agent-stall"
