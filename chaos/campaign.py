"""Drive a planned campaign against a running job, then judge it.

The runner (``resilient chaos run``) owns the job: it launches the agents and
knows their pids, the etcd members, the network lab and proxies. It exposes
them through :class:`JobHandles`; this module turns each
:class:`~.scenario.PlannedFault` into an :class:`~.injectors.Injector`
(:func:`make_injector`), fires it at its step or time while the job runs
(:class:`FaultDriver`, which tails the job's event logs), records every
injection in ``RUN_DIR/chaos/events.jsonl``, and after the run computes every
property and writes ``results.json`` (:func:`evaluate`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from resilient.events import EventLog

from .disk import FillDisk, FillStore, small_volume
from .injectors import (
    Action, ControlRequest, EtcdMemberKill, EtcdMemberLoss, HangProcess, InjectionFailed, InjectionRecord, Injector, KillProcess, Member,
    Preempt, emit_record,
)
from .jobs import LocalJob
from .netns import LinkCut, NetLab, PacketLoss, Partition
from .properties import (
    PropertyResult, commit_exactly_once, final_state_equal, no_committed_step_lost, no_leaks, recovery_within_bounds,
    stragglers_found, training_completed,
)
from .proxy import ProxyFault, TcpProxy
from .report import failed_record, write_results
from .scenario import PlannedFault, Scenario, as_dict
from .slow import AgentStall, SlowProcess
from .timeline import EventTail, episodes, load_timeline


class JobHandles(Protocol):
    """What the runner knows about the running job (duck-typed)."""

    run_dir: Path
    control_dir: Path                  # where ControlRequest files go (bitflip, storage-flaky)
    etcd_members: list[Member | int]
    netlab: NetLab | None              # topology.network = "netns"
    proxies: dict[str, TcpProxy]       # "etcd" / "rendezvous" → proxy in front of it
    durable_path: Path | None          # a SmallVolume's path, for disk-full

    def rank_pid(self, rank: int) -> int: ...
    def node_pid(self, node: int) -> int: ...          # the node's agent
    def node_shm(self, node: int) -> list[str]: ...    # its /dev/shm entries
    def node_alive(self, node: int) -> bool: ...
    def stop_node(self, node: int) -> Any: ...         # graceful leave (scale-down)
    def start_node(self, node: int) -> Any: ...        # join (scale-up)


class Unavailable(Injector):
    """A fault this job cannot carry (no network lab, no small volume):
    reported as skipped with the reason, never as injected."""

    def __init__(self, kind: str, reason: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.kind, self.reason = kind, reason

    def preflight(self) -> str | None:
        return self.reason

    def _inject(self) -> str:  # never reached: preflight always skips
        raise InjectionFailed(self.reason)


def make_injector(f: PlannedFault, job: JobHandles) -> Injector:
    """The injector for one planned fault; pids are resolved when it fires."""
    p, t = f.params, f.target
    kw = dict(target=str(t), fault_id=f.fault_id)
    k = f.kind
    if k == "kill-worker":
        return KillProcess(lambda: job.rank_pid(t.index), **kw)
    if k == "kill-node":
        shm = (lambda: job.node_shm(t.index)) if p.remove_shm else ()
        return KillProcess(lambda: job.node_pid(t.index), tree=True, shm_paths=shm, **kw)
    if k == "hang":
        src = (lambda: job.rank_pid(t.index)) if t.scope == "rank" else (lambda: job.node_pid(t.index))
        return HangProcess(src, tree=p.tree or t.scope == "node", **kw)
    if k == "preemption":
        grace = timedelta(seconds=p.grace_seconds)
        if t.scope == "rank":
            return Preempt(lambda: job.rank_pid(t.index), grace=grace, **kw)
        if t.scope == "all":
            return Preempt(lambda: [job.node_pid(n) for n in range(_nodes(job)) if job.node_alive(n)], grace=grace, tree=True, **kw)
        return Preempt(lambda: job.node_pid(t.index), grace=grace, tree=True, **kw)
    if k in ("partition", "link-cut", "packet-loss"):
        if job.netlab is None:
            return Unavailable(k, "the job runs without a network lab (topology.network = 'netns' and root needed)", **kw)
        if k == "partition":
            return Partition(job.netlab, t.index, **kw)
        if k == "link-cut":
            return LinkCut(job.netlab, t.index, t.other, **kw)
        return PacketLoss(job.netlab, t.index, p.probability, peer=t.other, **kw)
    if k in ("delay", "bandwidth", "reset"):
        proxy = job.proxies.get(t.scope)
        if proxy is None:
            return Unavailable(k, f"no TCP proxy in front of {t.scope}", **kw)
        return ProxyFault(proxy, k, delay=timedelta(milliseconds=p.delay_ms), bytes_per_second=p.bytes_per_second, refuse_new=p.refuse_new, **kw)
    if k == "etcd-loss":
        members = job.etcd_members
        if not members:
            return Unavailable(k, "no etcd members known to the runner", **kw)
        chosen = [members[(t.index + i) % len(members)] for i in range(p.members)]
        return EtcdMemberLoss(chosen, **kw)
    if k == "embedded-etcd-kill":
        if not job.etcd_members:
            return Unavailable(k, "no etcd members known to the runner", **kw)
        return EtcdMemberKill(job.etcd_members[t.index % len(job.etcd_members)],
                              settle=timedelta(seconds=p.settle_seconds), **kw)
    if k in ("storage-flaky", "bitflip"):
        params = dataclasses.asdict(p)
        if k == "bitflip":
            params["rank"] = t.index
        return ControlRequest(k, job.control_dir, job.run_dir, params=params, **kw)
    if k == "disk-full":
        if job.durable_path is None:
            return Unavailable(k, "the durable tier is not on a small volume (SmallVolume needs root)", **kw)
        return FillDisk(job.durable_path, **kw)
    if k == "store-full":
        store = getattr(job, "store_dir", None)
        if store is None or not small_volume(store):
            return Unavailable(k, "the node stores are not on a small volume (SmallVolume needs root)", **kw)
        return FillStore(store, **kw)
    if k in ("slow-rank", "slow-host"):
        src = (lambda: job.rank_pid(t.index)) if k == "slow-rank" else (lambda: job.node_pid(t.index))
        return SlowProcess(src, factor=p.factor, period=timedelta(milliseconds=p.period_ms), tree=k == "slow-host", **kw)
    if k == "first-agent-lost":
        return first_agent_lost(job, p, **kw)
    if k == "agent-stall":
        return AgentStall(lambda: job.node_pid(t.index), stall=timedelta(seconds=p.stall_seconds),
                          run=timedelta(seconds=p.run_seconds), **kw)
    if k == "slow-link":
        if job.netlab is None:
            return Unavailable(k, "the job runs without a network lab (topology.network = 'netns' and root needed)", **kw)
        loss = PacketLoss(job.netlab, t.index, p.probability, peer=t.other, **kw)
        loss.kind = k
        return loss
    if k == "scale-down":
        return Action(k, do=lambda: job.stop_node(t.index), check=lambda: not job.node_alive(t.index), settle=timedelta(seconds=60), **kw)
    if k == "scale-up":
        return Action(k, do=lambda: job.start_node(t.index), check=lambda: job.node_alive(t.index), settle=timedelta(seconds=60), **kw)
    raise ValueError(f"no injector for fault kind {k!r}")


def first_agent_lost(job: JobHandles, p, **kw: Any) -> Injector:
    """kill -9 of the tree of the agent that holds the run dir's control-plane claim (the one
    that started its embedded etcd; its etcd member is its child), and that member's data dir
    and the node's RAM store deleted: a lost first machine (issue 38)."""
    from resilient.control.claim import peek_owner
    from resilient.etcd.server import etcd_started_by

    def owner() -> int:
        rec = peek_owner(job.run_dir)
        if rec is None:
            raise InjectionFailed(f"no live agent holds the control-plane claim of {job.run_dir}")
        return rec.pid

    def lost_with_it() -> list[str]:
        pid = owner()
        paths = [str(d.parent if d.name == "data" else d) for _, d in etcd_started_by(pid)] if p.remove_data else []
        # A LocalJob knows its agents' pids and node stores; another JobHandles may not.
        name = getattr(job, "agent_pids", {}).get(pid, "")
        n = job.node_index(name) if name and hasattr(job, "node_index") else None
        if p.remove_shm and n is not None and hasattr(job, "node_store"):
            paths.append(str(job.node_store(n)))
        return paths

    inj = KillProcess(owner, tree=True, shm_paths=lost_with_it, **kw)
    inj.kind = "first-agent-lost"
    return inj


def _nodes(job: JobHandles) -> int:
    return getattr(job, "nodes", 0) or (len(job.netlab.namespaces) if job.netlab else 0)


def fault_duration(f: PlannedFault) -> timedelta | None:
    """How long a fault lasts before ``clear()``; None = cleared at the end."""
    p = f.params
    if f.kind == "preemption":
        return timedelta(seconds=p.grace_seconds)
    seconds = getattr(p, "seconds", None)
    if seconds is None:
        return timedelta(0)  # instantaneous: clear() just closes the record
    return timedelta(seconds=seconds) if seconds > 0 else None


@dataclasses.dataclass(frozen=True)
class Pace:
    """When a paced fault may fire: ``seats`` nodes in the newest round, its
    workers started training (a ``run_start`` after that round, of its
    world size), and ``steps`` distinct steps made since then and since the
    previous fault ended (steps of a group that is being replaced do not
    count); after ``timeout`` it fires anyway, recorded."""

    seats: int
    steps: int = 2
    timeout: timedelta = timedelta(minutes=3)


class FaultDriver:
    """Fires planned faults at their step or time, clears them when their
    duration ends, and logs every record to ``RUN_DIR/chaos/events.jsonl``.

    Time triggers count from the first ``step`` event (training started).
    Paced faults (:attr:`PlannedFault.paced`) fire one at a time, in plan
    order, each once the job recovered from the previous fault (:class:`Pace`);
    before each, nodes that a fault ended are started again (``job.heal``: a
    replacement node arrives), except the one the next scale-up brings back.
    ``pacing`` records, per paced fault, how long the job took to be back at
    full strength (``ready_seconds``, from injection) and any pace timeout.
    Run it in a thread (:meth:`start` / :meth:`stop`) or call :meth:`tick`
    from the runner's own loop. An injection that raises is recorded as
    ``failed`` (and fails the campaign); the driver goes on with the rest.
    """

    def __init__(self, plan: Iterable[PlannedFault], job: JobHandles, *, poll: timedelta = timedelta(milliseconds=200),
                 build: Callable[[PlannedFault, JobHandles], Injector] = make_injector, pace: Pace | None = None) -> None:
        self.pending = [f for f in plan if not f.paced]
        self.paced = [f for f in plan if f.paced]
        self.pace = pace or Pace(seats=int(getattr(job, "nodes", 1) or 1))
        self.pacing: list[dict] = []
        self._mark = 0.0               # when the previous paced fault ended
        self._last: dict | None = None  # its pacing row, until the job is ready again
        self._round: tuple[float, int, int] = (0.0, 0, 0)  # (time, nodes, world) of the newest rendezvous
        self._start: tuple[float, int] = (0.0, 0)  # (time, world) of the newest run_start
        self._recent: list[tuple[float, int]] = []  # (time, step) since the mark
        self.job, self.poll, self.build = job, poll, build
        self.tail = EventTail(job.run_dir)
        self.log = EventLog(Path(job.run_dir) / "chaos" / "events.jsonl", node="chaos", rank=-1)
        self.records: list[InjectionRecord] = []
        self.active: list[tuple[float | None, Injector]] = []  # (clear at, injector)
        self.max_step = -1
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _due(self, f: PlannedFault, now: float) -> bool:
        if f.at_step is not None:
            return self.max_step >= f.at_step
        return self.started_at is not None and now - self.started_at >= f.at.total_seconds()

    def tick(self, now: float | None = None) -> None:
        with self._lock:
            for e in self.tail.poll():
                if e.get("event") == "step":
                    self.max_step = max(self.max_step, int(e.get("step", -1)))
                    if self.started_at is None:
                        self.started_at = e.get("time", time.time())
                    self._recent.append((float(e.get("time", 0.0)), int(e.get("step", -1))))
                elif e.get("event") == "rendezvous" and float(e.get("time", 0.0)) >= self._round[0]:
                    self._round = (float(e.get("time", 0.0)), len(e.get("nodes", [])), int(e.get("world", 0) or 0))
                elif e.get("event") == "run_start" and float(e.get("time", 0.0)) >= self._start[0]:
                    self._start = (float(e.get("time", 0.0)), int((e.get("layout") or {}).get("world", 0) or 0))
            now = time.time() if now is None else now
            for f in [f for f in self.pending if self._due(f, now)]:
                self.pending.remove(f)
                self._fire(f)
            for item in [a for a in self.active if a[0] is not None and a[0] <= time.time()]:
                self.active.remove(item)
                self._clear(item[1])
                self._mark = time.time()
            if (self.paced or self._last is not None) and self.started_at is not None:
                self._pace(time.time())

    def done(self) -> bool:
        """Every planned fault fired and ended, and the job recovered from the last paced one."""
        with self._lock:
            return (not self.pending and not self.paced and self._last is None
                    and not any(a[0] is not None for a in self.active))

    def _pace(self, now: float) -> None:
        """Fire the next paced fault when the job is back at full strength."""
        if any(a[0] is not None for a in self.active):
            return  # the previous fault still lasts
        if not self._mark:
            self._mark = self.started_at or now
        nxt = self.paced[0] if self.paced else None
        keep = {nxt.target.index} if nxt is not None and nxt.kind == "scale-up" and nxt.target.index is not None else set()
        heal = getattr(self.job, "heal", None)
        try:
            healed = heal(keep) if heal is not None and self._last is not None else []
        except Exception as e:  # a replacement that cannot start: recorded, and the job is judged as it is
            healed = []
            if self._last is not None:
                self._last["heal_error"] = f"{type(e).__name__}: {e}"
        if healed:
            self._mark = now
            self._last["replaced"] = self._last.get("replaced", []) + healed
        since = max(self._mark, self._round[0], self._start[0])
        self._recent = [(t, s) for t, s in self._recent if t > self._mark]
        steps = {s for t, s in self._recent if t > since}
        started = self._start[0] >= self._round[0] and (not self._round[2] or self._start[1] == self._round[2])
        ready = self._round[1] >= self.pace.seats and started and len(steps) >= self.pace.steps
        late = now - self._mark > self.pace.timeout.total_seconds()
        if not (ready or late):
            return
        # The previous fault's recovery is measured at the scenario's pace; the next one
        # may want more steps behind it (a fail-slow fault: the detector's warm-up).
        if ready and not late and nxt is not None and len(steps) < nxt.pace_steps:
            if self._last is not None:
                self._last["ready_seconds"] = round(now - self._last["injected_at"], 2)
                self._last = None
            return
        if self._last is not None:
            if ready:
                self._last["ready_seconds"] = round(now - self._last["injected_at"], 2)
            else:
                self._last["not_ready"] = (f"{self.pace.timeout} after it ended: {self._round[1]} of {self.pace.seats} "
                                           f"seats, {'training' if started else 'not training'}, {len(steps)} new steps")
            self._last = None
        if nxt is None:
            return
        self.paced.pop(0)
        self._fire(nxt)
        rec = self.records[-1]
        self._last = {"fault_id": nxt.fault_id, "kind": nxt.kind, "status": rec.status, "injected_at": rec.injected_at or now}
        self.pacing.append(self._last)
        self._mark = time.time()

    def _fire(self, f: PlannedFault) -> None:
        try:
            inj = self.build(f, self.job)
            rec = inj.inject()
        except Exception as e:  # InjectionFailed, or a bug in a handle: either fails the campaign
            rec = failed_record(f.kind, str(f.target), f.fault_id, e)
            self.records.append(rec)
            emit_record(self.log, rec)
            return
        self.records.append(rec)
        emit_record(self.log, rec)
        if rec.status == "injected":
            d = fault_duration(f)
            self.active.append((None if d is None else time.time() + d.total_seconds(), inj))

    def _clear(self, inj: Injector) -> None:
        try:
            rec = inj.clear()
        except Exception as e:
            rec = failed_record(inj.kind, inj.target, inj.fault_id, e)
            rec.detail = "clear failed: " + rec.detail
            self.records.append(rec)
        if rec is not None:
            emit_record(self.log, rec, cleared=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll.total_seconds()):
            self.tick()

    def start(self) -> "FaultDriver":
        self._thread = threading.Thread(target=self._loop, name="chaos-driver", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: timedelta = timedelta(seconds=60)) -> list[InjectionRecord]:
        """Stop firing, clear every active fault (even never-ending ones),
        and return the records. Faults never reached stay unfired; the
        report lists the fired ones only."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())
        with self._lock:
            for _, inj in self.active:
                self._clear(inj)
            self.active.clear()
        self.log.close()
        return self.records


def evaluate(sc: Scenario, run_dir: str | Path, records: list[InjectionRecord], *, reference: Any = None, actual: Any = None,
             diff: Callable[[Any, Any], float] | None = None, leaks: dict | None = None,
             expected_commits: dict | None = None, extra: dict | None = None,
             more: Iterable[PropertyResult] = ()) -> list[PropertyResult]:
    """Compute the scenario's properties on the finished run and write
    ``results.json``. ``reference``/``actual`` are final-state digests (or
    whatever ``diff`` compares); ``leaks`` are :func:`no_leaks` keyword
    arguments (shm_prefix, shm_paths, ports, mounts, labs); ``more`` are
    verdicts the runner computed itself (faults fired, budget kept)."""
    pr = sc.properties
    tl = load_timeline(run_dir)
    eps = episodes(tl)
    bounds = {f.fault_id: f.recovery_bound for f in sc.plan()}
    out: list[PropertyResult] = []
    if pr.no_committed_step_lost:
        out.append(no_committed_step_lost(tl, pr.surviving_tiers))
    if pr.commit_exactly_once:
        out.append(commit_exactly_once(tl, expected_commits))
    out.append(recovery_within_bounds(eps, bounds, default=timedelta(seconds=pr.recovery_bound_seconds)))
    if pr.training_completes:
        steps = _train_steps(sc)
        out.append(training_completed(tl, steps) if steps is not None else
                   PropertyResult("training_completed", False, f"cannot read train.steps from {sc.training.config} or the overrides"))
    if pr.final_state != "skip":
        out.append(final_state_equal(reference, actual, diff=diff if pr.final_state == "tolerance" else None, tolerance=pr.tolerance))
    if pr.straggler_within_steps:
        out.append(stragglers_found(tl, pr.straggler_within_steps, LocalJob.node_id, sc.topology.workers_per_node))
    if pr.no_leaks:
        out.append(no_leaks(run_dir, **(leaks or {})))
    out.extend(more)
    write_results(run_dir, scenario=as_dict(sc), properties=out, injections=records, extra=extra)
    return out


def _train_steps(sc: Scenario) -> int | None:
    """train.steps after the scenario's overrides (None if unknown here)."""
    for item in reversed(sc.training.overrides):
        key, _, val = item.partition("=")
        if key.strip() == "train.steps":
            return int(val)
    from resilient.gpt.config import load_config
    from resilient.errors import ConfigError
    try:
        return load_config(sc.training.config).train.steps
    except ConfigError:
        return None
