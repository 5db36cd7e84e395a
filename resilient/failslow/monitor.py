"""The fail-slow checks of one rank, driven by :class:`~resilient.job.Job`'s step boundary.

The job already runs one small gloo all-reduce per step (every rank agrees on a
preemption's last step, :meth:`Job._stop_agreed`). :class:`FailSlowMonitor`
owns that exchange, and every ``every`` steps hands this rank's six timing
numbers (:data:`~resilient.failslow.api.PHASES`, 48 bytes) to its
:class:`~resilient.failslow.courier.Courier`, whose thread sends them to rank 0
in a gather on a gloo group of its own and, on rank 0, has them judged: the
training thread only pays a lap of the step timer and a queue put. A gather,
not an all-reduce of everyone's numbers: each rank sends one message instead
of a ring's 2(world - 1), and one detector runs instead of one per rank. Side
by side on 4 gloo ranks on 2 cores, an all-reduce of the 24 numbers beside the
step cost 6-7% of a 26 ms step (each ring message a context switch on
oversubscribed cores), a gather nothing measurable (bench/failslow.py).

A verdict names the step whose timings showed it. The step boundary itself
only waits for the one-element stop flag, as before; rank 0 adds to it that its
courier has verdicts (a SUM of stop bits, plus world + 1 from rank 0), and only
then does every rank read them from rank 0 (a broadcast of their JSON; rare):
every rank acts on a verdict together (a probe and a replace decision are
collective), usually one or two steps after the step it names. The exchange's
own wait, where fast ranks wait for a slow one when the loop has no collective
of its own, counts in the next interval.

Rank 0 writes the ``straggler`` event with the policy's decision and
arithmetic. A suspected link is probed first (:mod:`~resilient.failslow.probe`,
every rank together, once per suspicion): a process slow inside the
collectives looks like a slow link from the step timings alone.

Under ``failslow.policy = "replace"`` a verdict that pays (:mod:`~.policy`) and
has a seat to hand over (each rank's agent says whether a warm spare waits or
the job may shrink: :mod:`~.replace`) is first confirmed by the probe (the slow
ranks' compute must be slow there too), then acted on: every rank stops after
the same step (the exchange says stop, as for a preemption), saves it, and
leaves; the slow node's ranks leave with ``WorkerExit.SLOW``, so their agent marks
the node and hands its seat over, the others with ``WorkerExit.PEER_LEFT``, so theirs
re-form at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from statistics import median
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from resilient.failslow.api import PHASES, FailSlowConfig, Straggler
from resilient.failslow.detector import WALL, Detector
from resilient.failslow.courier import LINK, Courier
from resilient.failslow.policy import Decision, decide
from resilient.failslow.probe import SLOW_COMPUTE, judge, run_probe
from resilient.failslow.replace import agree, note_leaving
from resilient.failslow.timing import CollectiveClock, StepTimer

N = len(PHASES)
# A replace that would pay but found no seat (no spare up yet, no shrink allowed) asks again
# this many exchanges later: a spare started meanwhile takes the seat then, and a slowdown
# that lasts does not write a straggler event every few steps meanwhile.
NO_SEAT_RETRY = 30
# A verdict the probe did not bear out (a link it could not locate, a rank it did not find
# slow) is forgotten after this many exchanges, so the evidence builds up afresh and the probe
# runs again if the slowdown lasts. Why: one probe is a sample. A lossy TCP link is slow on
# average, not on every message; a probe of a few messages can miss its retransmission stalls
# (the CI campaign's fifth of the packets dropped: steps 10x slower, and one probe found every
# edge alike, once in a few runs); a rank's probe can land in a lull of its slowdown. One miss
# used to silence the verdict for the whole slowdown (a raised signal stays raised while slow).
PROBE_RETRY = 4
# A located link is probed a second time and named only where both probes place it. Why: on
# a loaded host a clean edge's round trips can stall on scheduling (10x the fastest edge)
# while a lossy edge's sample misses its retransmission stalls; one CI campaign named the
# lossy node's neighbour that way. Two probes that disagree are a link not located (retried).
# A second probe that locates nothing (no edge past SLOW_EDGE: the lossy path's round trips
# happened not to stall) neither agrees nor disagrees: a third decides. Why: CI's short
# slow-link campaign failed so twice (stop 49's CI, and fresh-ci on fbc1745: first probe at
# n1 with n1's edges 0.32 and 0.21 s against 0.0014 s, the second found every edge alike, and
# the run ended before the retry's probe).
# A suspected rank (detector.py) is named only if the probe times its compute at least this
# much slower than the others': higher than a verdict's own probe check (SLOW_COMPUTE), as
# the timings alone were not sure (a slowed rank measured 4.9-5.6x in the soak).
SUSPECT_CONFIRM = 1.5


def process_age_seconds() -> float:
    """Seconds since this process started: what its start (imports, set-up, restore) cost."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


# How long a probe may keep its worker's heartbeat going. Why: a probe is a step boundary
# with no beat, and over the link it probes it is as slow as that link: ~7 s each on an idle
# host for the CI campaign's fifth of the packets dropped, several times that on a loaded one,
# past the agent's 30 s deadline, which then killed healthy workers as hung and re-formed the
# job before the link was named. A probe hung on a dead peer is still found, this much later.
PROBE_BOUND = timedelta(minutes=2)


def _no_keep_alive(bound: timedelta) -> ContextManager[Any]:
    return contextlib.nullcontext()


class FailSlowMonitor:
    """See the module doc. ``group``: the gloo group of the step-boundary all-reduce (None
    for a job of one rank: the timer still runs for ``job.phase``, nothing is judged)."""

    def __init__(self, cfg: FailSlowConfig, *, group: Any, rank: int, world: int, node: str, events: Any,
                 device: Any = None, trace: str | os.PathLike | None = None,
                 keep_alive: Callable[[timedelta], ContextManager[Any]] = _no_keep_alive):
        """``keep_alive(bound)``: a context that tells the agent this worker is alive for up to
        ``bound`` (the worker's heartbeat, :meth:`HeartbeatWriter.while_waiting`), held while a
        probe runs."""
        cfg.validate()
        self.keep_alive = keep_alive
        self.cfg, self.group, self.rank, self.world, self.events = cfg, group, rank, world, events
        self.device = device   # where the probe computes
        self.clock = CollectiveClock().install() if cfg.enable else None
        self.timer = StepTimer(self.clock, queued=cfg.enable)
        self.courier: Courier | None = None   # carries the timings to rank 0 and judges them there
        self.nodes: list[str] = [node]
        self._judge = cfg.enable and group is not None
        if self._judge:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, node, group=group)   # once, at start: who runs where
            self.nodes = [str(n) for n in gathered]
            # the timings' own group: the courier's thread issues its gathers there, in its order
            lane = dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")
            self.courier = Courier(lane, rank, world, N, Detector(cfg, self.nodes) if rank == 0 else None,
                                   trace=trace if cfg.trace else None)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self._flag = torch.zeros(1, dtype=torch.float64)
        self._raised: set[int] = set()   # ranks rank 0's detector holds judged (a probe must not name them again)
        self._boundary = 0   # the step of the boundary being run (what every rank saves if it stops)
        self._pending = [0.0] * N
        self._calls = 0
        self.total_steps: int | None = None    # the run's length, for the cost model (Job.steps sets it)
        self.reform_seconds = cfg.reform_seconds or None
        self.stragglers: list[tuple[Straggler, Decision]] = []
        self.replacing: dict | None = None   # replace: what every rank stops for (the failslow_replace fields)
        self.leaving = False                 # ... and this rank's node is the one that leaves

    @property
    def history(self) -> list | None:
        """Rank 0: a list to keep every (step, timing matrix) judged in (bench/failslow.py)."""
        return self.courier.history if self.courier is not None else None

    @history.setter
    def history(self, value: list | None) -> None:
        if self.courier is not None:
            self.courier.history = value

    def phase(self, name: str) -> ContextManager[None]:
        return self.timer.phase(name)

    def exchange(self, stop: bool, step: int) -> bool:
        """The step boundary: the stop flag agreed by every rank (a one-element all-reduce, as
        ever), rank 0's verdicts acted on by every rank, and, when due, this step's timings
        handed to the courier, whose thread carries them to rank 0 to be judged (module doc).
        Collective."""
        lap = self.timer.lap()   # the step that just ended (the previous exchange's wait included)
        if self._calls == 0:
            # the time before the first exchange is start-up, not a step
            if self.reform_seconds is None:
                self.reform_seconds = process_age_seconds()
        else:
            self._pending = [a + b for a, b in zip(self._pending, lap)]
        due = self._judge and self._calls > 0 and self._calls % self.cfg.every == 0
        self._calls += 1
        self._boundary = step
        if due:   # this rank's timings to rank 0, by the courier's thread (courier.py)
            self.courier.submit(step, self._pending)
            self._pending = [0.0] * N
        found = self.courier.take() if self.courier is not None and self.rank == 0 else None
        # a SUM of the stop bits (≤ world), plus world + 1 from rank 0 when it has verdicts
        self._flag[0] = float(stop) + (self.world + 1 if found else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.SUM, group=self.group)
        total = round(self._flag[0].item())
        agreed = total % (self.world + 1) > 0
        if total > self.world:
            # every rank acts on rank 0's verdicts together, before anything else on the group
            # (a verdict's probe is collective too)
            found = self._from_root(found)
            self._raised = set(found["raised"])
            for fields in found["verdicts"]:
                self._verdict(Straggler(**fields), found["rows"])
        # a replace decision stops every rank after this step, as a preemption does (Job.finish)
        return agreed or self.replacing is not None

    def _from_root(self, found: dict | None) -> dict:
        """Rank 0's verdicts on every rank: JSON bytes broadcast over the group (collective)."""
        data = json.dumps(found).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=self._root, group=self.group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=self._root, group=self.group)
        return json.loads(buf.numpy().tobytes())

    def _hold(self, ranks: list[int]) -> None:
        """A verdict on these ranks reached through the probe: the timing signal must not say it again."""
        self._raised.update(ranks)
        if self.courier is not None:
            self.courier.hold(ranks)

    def _probe(self) -> dict:
        with self.keep_alive(PROBE_BOUND):
            compute, edges = run_probe(self.group, self.rank, self.world, self.device)
        self.timer.lap()   # the probe is no step's time
        return judge(compute, edges, self.nodes)

    def _probed(self, s: Straggler) -> Straggler | None:
        """A suspected link, probed: a slow device or host after all, the link located, or
        None: nothing slower than the rest (every edge and rank alike): the whole job's
        network slowed down, which is no straggler; or a located link that a second probe did not
        place at the same node (see PROBE_RETRY)."""
        j = self._probe()
        if j["cause"] in ("device", "host"):
            if all(r in self._raised for r in j["slow_ranks"]):
                return None   # the slow rank the timings already named: its waits, not a link
            self._hold(j["slow_ranks"])
        else:
            if j["slow_rank"] is not None:
                # every rank judges the same all-reduced vectors, so all run the second probe or none
                again = self._probe()
                if again["cause"] == "link" and again["slow_node"] is None:
                    again = self._probe()   # inconclusive: the third decides (see above)
                if again["cause"] != "link" or again["slow_node"] != j["slow_node"]:
                    j = {**j, "slow_rank": None, "evidence": {
                        **j["evidence"], "unconfirmed_at": j["slow_node"],
                        "second_probe": {**again["evidence"], "slow_node": again["slow_node"]}}}
                else:
                    j["evidence"]["second_probe"] = again["evidence"]
            if j["slow_rank"] is None:
                if self.rank == 0:
                    self.events.emit("failslow_probe", step=s.step, suspected="link", located=False,
                                     evidence={**s.evidence, **j["evidence"]})
                if self.courier is not None:
                    self.courier.retry([LINK], PROBE_RETRY)
                return None
        evidence = {**s.evidence, **j["evidence"], "probed": True,
                    "probe_factor": round(j["factor"], 3) if j["factor"] else None}
        return Straggler(step=s.step, cause=j["cause"], factor=s.factor, slow_rank=j["slow_rank"],
                         slow_ranks=j["slow_ranks"], slow_node=j["slow_node"],
                         steps_of_evidence=s.steps_of_evidence, evidence=evidence)

    def _device_probed(self, s: Straggler) -> Straggler | None:
        """A rank (or a host: its node's ranks) the timings name, probed: named if its compute
        is slow beside the others' (alone: a device; with all its node mates: the host: the
        probe, not the timings, says which), else let go (a ``failslow_probe`` event). A suspect
        (evidence past the configured level, not past its noise's: detector.py) needs the probe
        to find more. Why every one: on the soak's host, the timings alone named ranks nobody
        had slowed (its own time swings 0-200 ms a step). Why a host's too: the timings call it
        a host when every mate's evidence is past half the level; on CI's loaded host rank 0,
        the slowed rank's mate there (it gathers the timings), got there with the slowed rank
        alone stopped, and the campaign's device was named a host (the CI of 36567bf)."""
        j = self._probe()
        evidence = {**s.evidence, **j["evidence"], "probed": True}
        need = SUSPECT_CONFIRM if s.evidence.get("suspected") else SLOW_COMPUTE
        if j["cause"] in ("device", "host") and s.slow_rank in j["slow_ranks"] and j["factor"] >= need:
            self._hold(j["slow_ranks"])
            if self.courier is not None and (spared := [r for r in s.slow_ranks if r not in j["slow_ranks"]]):
                # the timings' host verdict raised every mate; the probe found this rank alone
                # slow: the mates are judged afresh (one that goes slow later is named then)
                self.courier.retry(spared, PROBE_RETRY)
            return Straggler(step=s.step, cause=j["cause"], factor=s.factor, slow_rank=s.slow_rank,
                             slow_ranks=j["slow_ranks"], slow_node=s.slow_node, steps_of_evidence=s.steps_of_evidence,
                             evidence={**evidence, "probe_factor": round(j["factor"], 3)})
        if self.rank == 0:
            self.events.emit("failslow_probe", step=s.step, suspected="device", slow_rank=s.slow_rank,
                             located=False, evidence=evidence)
        # not named: a link's probe that finds this rank slow later must name it (_probed)
        self._raised.difference_update(s.slow_ranks)
        if self.courier is not None and not s.evidence.get("suspected"):
            # a suspect was never raised (detector.SUSPECT_COOLDOWN spaces its probes)
            self.courier.retry(s.slow_ranks, PROBE_RETRY)
        return None

    def _verdict(self, s: Straggler, rows: list[list[float]]) -> None:
        # every verdict is probed before it is named: a link located, a device or a host borne out
        probed = self._probed(s) if s.cause == "link" else self._device_probed(s)
        if probed is None:
            return
        s = probed
        step_seconds = median(r[WALL] for r in rows) / self.cfg.every
        remaining = self.total_steps - s.step if self.total_steps is not None else None
        reform, seat = self.reform_seconds or 0.0, None
        if self.cfg.policy == "replace" and self.replacing is None and s.cause != "link":
            # collective: every rank acts on this verdict together, and must weigh the same
            # re-form cost (each measured its own start)
            seat, reform = agree(self.group, reform)
        d = decide(self.cfg, s, seat=seat, step_seconds=step_seconds, remaining_steps=remaining,
                   reform_seconds=reform)
        if d.action == "replace":
            d = self._confirm(s, d)
        elif d.pays and d.seat == "none" and self.courier is not None:
            self.courier.retry(s.slow_ranks, NO_SEAT_RETRY)
        self.stragglers.append((s, d))
        if self.rank == 0:
            self.events.emit("straggler", **s.event_fields(), decision=d.fields())
        if self.replacing is not None and self.leaving and self.rank == self.nodes.index(s.slow_node):
            self.events.emit("failslow_replace", **self.replacing)   # the node's agent reads it (replace.py)

    def _confirm(self, s: Straggler, d: Decision) -> Decision:
        """Before a node is sent away: the probe (collective) must find its ranks' compute slow
        too, beside the others' (a verdict on a rank that was starved, not slow, is not acted
        on). The others' probe time is the reference the node must meet to rejoin."""
        compute = s.evidence.get("probe_compute_seconds")
        if compute is None:
            compute, _ = run_probe(self.group, self.rank, self.world, self.device)
            self.timer.lap()   # the probe is no step's time
        healthy = [c for r, c in enumerate(compute) if self.nodes[r] != s.slow_node]
        reference = median(healthy) if healthy else None
        slowest = max(compute[r] for r in s.slow_ranks)
        ratio = slowest / reference if reference else None
        if ratio is None or ratio < SLOW_COMPUTE:
            d.action = "report"
            d.reason += (f"; not replaced: the probe did not find node {s.slow_node}'s compute slow "
                         f"(x{ratio:.2f} < {SLOW_COMPUTE})" if ratio is not None else
                         "; not replaced: no other node to probe against")
            return d
        d.reason += f" (the probe confirms: x{ratio:.2f})"
        # every rank stops after the step of this boundary (the verdict judged an earlier one)
        self.replacing = {"step": self._boundary, "verdict_step": s.step, "slow_node": s.slow_node,
                          "slow_ranks": s.slow_ranks, "cause": s.cause, "factor": round(s.factor, 4), "seat": d.seat, "probe_seconds": round(slowest, 6),
                          "reference_seconds": round(reference, 6), "device": str(self.device or "cpu")}
        self.leaving = self.nodes[self.rank] == s.slow_node
        if self.leaving:
            note_leaving(self.replacing)
        return d

    def close(self, failed: bool = False) -> None:
        if self.courier is not None:
            self.courier.close(failed)
            self.courier = None
        self.timer.close()
        if self.clock is not None:
            self.clock.uninstall()
            self.clock = None
