"""The fail-slow checks of one rank, driven by :class:`~resilient.job.Job`'s step boundary.

The job already runs one small gloo all-reduce per step (every rank agrees on a
preemption's last step, :meth:`Job._stop_agreed`). :class:`FailSlowMonitor`
owns that exchange: every ``every`` steps the tensor carries, besides the stop
flag, each rank's five timing numbers (:data:`~resilient.failslow.api.PHASES`)
in its own slot (a MAX all-reduce of non-negative numbers over zeros is a
gather), so the timings cost no collective of their own: 48 bytes per rank per
exchange. Each exchange carries the step that just ended (no lag: a verdict
at the boundary after step *s* has seen step *s*); the exchange's own wait,
where fast ranks wait for a slow one when the loop has no collective of its
own, counts in the next interval.

Every rank runs the same :class:`~resilient.failslow.detector.Detector` on the
same numbers, so every rank reaches the same verdict at the same step; rank 0
writes the ``straggler`` event with the policy's decision and arithmetic. A
suspected link is probed first (:mod:`~resilient.failslow.probe`, every rank
together, once per suspicion): a process slow inside the collectives looks
like a slow link from the step timings alone.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from resilient.failslow.api import PHASES, FailSlowConfig, Straggler
from resilient.failslow.detector import WALL, Detector
from resilient.failslow.policy import Decision, decide
from resilient.failslow.probe import judge, run_probe
from resilient.failslow.timing import CollectiveClock, StepTimer

N = len(PHASES)


def process_age_seconds() -> float:
    """Seconds since this process started: what its start (imports, set-up, restore) cost."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


class FailSlowMonitor:
    """See the module doc. ``group``: the gloo group of the step-boundary all-reduce (None
    for a job of one rank: the timer still runs for ``job.phase``, nothing is judged)."""

    def __init__(self, cfg: FailSlowConfig, *, group: Any, rank: int, world: int, node: str, events: Any,
                 device: Any = None):
        cfg.validate()
        self.cfg, self.group, self.rank, self.world, self.events = cfg, group, rank, world, events
        self.device = device   # where the probe computes
        self.clock = CollectiveClock().install() if cfg.enable else None
        self.timer = StepTimer(self.clock)
        self.detector: Detector | None = None
        self.nodes: list[str] = [node]
        if cfg.enable and group is not None:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, node, group=group)   # once, at start: who runs where
            self.nodes = [str(n) for n in gathered]
            self.detector = Detector(cfg, self.nodes)
        self._flag = torch.zeros(1, dtype=torch.float64)
        self._buf = torch.zeros(1 + N * world, dtype=torch.float64) if self.detector is not None else None
        self._pending = [0.0] * N
        self._calls = 0
        self.total_steps: int | None = None    # the run's length, for the cost model (Job.steps sets it)
        self.reform_seconds = cfg.reform_seconds or None
        self.stragglers: list[tuple[Straggler, Decision]] = []
        self.history: list | None = None   # a list to keep every (step, timing matrix) in (bench/failslow.py)

    def phase(self, name: str) -> ContextManager[None]:
        return self.timer.phase(name)

    def exchange(self, stop: bool, step: int) -> bool:
        """The step boundary's all-reduce: the stop flag agreed by every rank (and, when
        due, the timings judged). Collective."""
        lap = self.timer.lap()   # the step that just ended (the previous exchange's wait included)
        if self._calls == 0:
            # the time before the first exchange is start-up, not a step
            if self.reform_seconds is None:
                self.reform_seconds = process_age_seconds()
        else:
            self._pending = [a + b for a, b in zip(self._pending, lap)]
        due = self._buf is not None and self._calls > 0 and self._calls % self.cfg.every == 0
        self._calls += 1
        if due:
            buf = self._buf
            buf.zero_()
            buf[1 + N * self.rank: 1 + N * (self.rank + 1)] = torch.tensor(self._pending, dtype=torch.float64)
        else:
            buf = self._flag
        buf[0] = float(stop)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        agreed = bool(buf[0].item())
        if due:
            self._pending = [0.0] * N
            rows = buf[1:].view(self.world, N).tolist()
            if self.history is not None:
                self.history.append((step, rows))
            for s in self.detector.observe(step, rows):
                self._verdict(s, rows)
        return agreed

    def _probed(self, s: Straggler) -> Straggler | None:
        """A suspected link, probed: a slow device or host after all, the link located, or
        None: nothing slower than the rest (every edge and rank alike): the whole job's
        network slowed down, which is no straggler."""
        compute, edges = run_probe(self.group, self.rank, self.world, self.device)
        self.timer.lap()   # the probe is no step's time
        j = judge(compute, edges, self.nodes)
        if j["cause"] in ("device", "host"):
            if all(self.detector.ranks[r].raised for r in j["slow_ranks"]):
                return None   # the slow rank the timings already named: its waits, not a link
            self.detector.hold(j["slow_ranks"])   # the timing signal must not say it again
        elif j["slow_rank"] is None:
            return None
        evidence = {**s.evidence, **j["evidence"], "probed": True,
                    "probe_factor": round(j["factor"], 3) if j["factor"] else None}
        return Straggler(step=s.step, cause=j["cause"], factor=s.factor, slow_rank=j["slow_rank"],
                         slow_ranks=j["slow_ranks"], slow_node=j["slow_node"],
                         steps_of_evidence=s.steps_of_evidence, evidence=evidence)

    def _host_or_device(self, s: Straggler) -> Straggler:
        """A slow rank with node mates, probed: are they all slow (the host) or is it alone?
        Their timing signals rarely cross together (each is stopped or starved at its own
        points of the step); one probe of every rank's compute answers at once."""
        compute, edges = run_probe(self.group, self.rank, self.world, self.device)
        self.timer.lap()
        j = judge(compute, edges, self.nodes)
        evidence = {**s.evidence, **j["evidence"], "probed": True}
        if j["cause"] == "host" and j["slow_node"] == s.slow_node:
            self.detector.hold(j["slow_ranks"])
            return Straggler(step=s.step, cause="host", factor=s.factor, slow_rank=s.slow_rank,
                             slow_ranks=j["slow_ranks"], slow_node=s.slow_node,
                             steps_of_evidence=s.steps_of_evidence, evidence=evidence)
        s.evidence = evidence
        return s

    def _verdict(self, s: Straggler, rows: list[list[float]]) -> None:
        if s.cause == "link":
            probed = self._probed(s)
            if probed is None:
                return
            s = probed
        elif s.cause == "device" and 1 < self.nodes.count(s.slow_node) < self.world:
            s = self._host_or_device(s)
        step_seconds = median(r[WALL] for r in rows) / self.cfg.every
        remaining = self.total_steps - s.step if self.total_steps is not None else None
        d = decide(self.cfg, s, step_seconds=step_seconds, remaining_steps=remaining,
                   reform_seconds=self.reform_seconds or 0.0)
        self.stragglers.append((s, d))
        if self.rank == 0:
            self.events.emit("straggler", **s.event_fields(), decision=d.fields())

    def close(self) -> None:
        if self.clock is not None:
            self.clock.uninstall()
            self.clock = None
