"""The resilient agent: torch's ``SimpleElasticAgent`` with warm workers,
heartbeats, node liveness and preemption.

torch's agent loop (``SimpleElasticAgent._invoke_run``) stays in charge of the
life cycle::

    rendezvous → start workers → monitor ─┬─ SUCCEEDED → exit barrier → done
          ▲                               ├─ FAILED / UNHEALTHY → restart (counted)
          └───────────────────────────────┴─ nodes waiting → restart (scale up)

This class supplies the four hooks it leaves abstract and adds:

- ``_start_workers`` hands each local rank a *warm* process: a fork of the
  pool's zygote (torch and the program's modules already imported, see
  :class:`~.pool.WarmPool`), so a restart costs a fork, not an import; the
  agent joins its first rendezvous only once that zygote is ready;
- ``_rendezvous`` first evicts members proven dead (their agent's port
  refuses connections, :meth:`NodeRegistry.proven_dead`), and joins the next
  round when the one just completed lost a member before the workers started
  (:class:`RendezvousRoundLost`), instead of waiting out the store timeout;
- ``_monitor_workers`` reports FAILED on a non-zero exit, UNHEALTHY on a
  missed heartbeat, and restarts at once (not counted against
  ``max_restarts``) when another node of the round lost its liveness key;
- ``_shutdown`` on SIGTERM is a preemption: workers get SIGTERM and a grace
  period to finish the step and snapshot, then the node leaves the rendezvous
  and revokes its lease, so the others re-form now instead of after a timeout.
  SIGINT (Ctrl-C) stops the node the same way. Only a signal from outside is a
  preemption: torch's ``run()`` also calls ``_shutdown`` with its default
  SIGTERM when the loop raises, and such a stop keeps the reason the loop gave;
- an etcd outage is ridden through: the workers train on (their snapshots stay
  in the node's RAM) while the rendezvous cannot be read, for at most
  ``etcd_outage``; then the node stops with :class:`EtcdOutage`. At the end an
  etcd that is gone (the owner of an embedded one left first) is not called.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousGracefulExitError

from resilient.agent.api import AgentError, AgentSettings, FailureKind
from resilient.agent.heartbeat import HeartbeatMonitor
from resilient.agent.membership import NodeRegistry, exchange_node_ids
from resilient.agent.metrics import AgentMetrics, QuarantineCount
from resilient.agent.pool import WarmPool, WorkerProcess
from resilient.agent.quarantine import Quarantine
from resilient.agent.seats import SeatHandover
from resilient.contract import (HEARTBEAT_ENV, NODE_ID_ENV, ROUND_ENV, RUN_DIR_ENV, RUNTIME_CONFIG_ENV, WorkerExit,
                                events_path)
from resilient.etcd import EtcdError
from resilient.etcd.compactor import HistoryCompactor
from resilient.events import EventLog, read_events
from resilient.ledger import run_copies
from resilient.procs import OWNER, ignore_stop_signals, owner_record, reclaim_dirs
from resilient.rendezvous.api import RendezvousRoundLost, RendezvousUnavailable

log = logging.getLogger(__name__)
# How long etcd gets to answer before a lost node is taken to have taken the control plane
# with it. One endpoint (one member) answers at once or is gone. Several (an embedded etcd
# grown into a cluster: resilient.control.members) elect a new leader when the lost node's
# member led (1-2 s of election timeouts on a loaded host), and every client logs in again on
# the member it fails over to (etcd 3.4's tokens are a member's own, and a login goes through
# raft): 1 s declared the job lost while the cluster re-formed.
CONTROL_PLANE_CHECK = timedelta(seconds=1)
CLUSTER_CONTROL_PLANE_CHECK = timedelta(seconds=10)

MAX_STARTUP_FAILURES = 3
# Rounds lost in a row (a member died between completing the round and starting
# its workers) before the agent gives up: each attempt is a real re-join, bounded
# by the join timeout, so this only stops a loop that would never settle.
MAX_LOST_ROUNDS = 20


class EtcdOutage(AgentError):
    """etcd stayed unreachable for longer than ``launch.etcd_outage``: the node stopped."""

    def __init__(self, endpoint: str, down: timedelta, bound: timedelta, run_dir: str):
        self.endpoint, self.down, self.bound, self.run_dir = endpoint, down, bound, run_dir
        super().__init__(endpoint, down, bound)

    def __str__(self) -> str:
        # Composed when printed: by then the workers have saved their newest step.
        newest = newest_durable(events_path(self.run_dir))
        saved = (f"the newest durable version is step {newest['step']} at {newest.get('url')}" if newest
                 else "no durable version was written")
        return (f"etcd at {self.endpoint} has been unreachable for {self.down.total_seconds():.0f} s "
                f"(launch.etcd_outage = {self.bound.total_seconds():.0f} s): this node stopped its workers "
                f"after they saved their newest step; {saved}. Relaunch the same command once etcd answers "
                "(check it with `etcdctl --endpoints ... endpoint health`): the job resumes from the newest "
                "durable version")


class ControlPlaneLost(AgentError):
    """etcd stopped answering and nodes of this round are certainly gone (their agents' pids
    are gone from this host, or their ports refuse connections): the control plane left with
    them (the embedded etcd of the first agent, say). Waiting for it is pointless: the node
    stops at once, after making its newest whole version durable."""

    def __init__(self, endpoint: str, lost: list[str], nodes: list[str], run_dir: str):
        self.endpoint, self.lost, self.nodes, self.run_dir = endpoint, lost, nodes, run_dir
        super().__init__(endpoint, lost)

    def __str__(self) -> str:
        newest = newest_durable(events_path(self.run_dir))
        saved = (f"the newest durable version is step {newest['step']} at {newest.get('url')}" if newest
                 else "no durable version was written; this node's RAM store is kept for a relaunch on this machine")
        lost = ", ".join(repr(n) for n in self.lost)
        return (f"node(s) {lost} of this run are gone (agent process gone or its port refuses connections), and "
                f"etcd at {self.endpoint} went with them: no node can re-form the job. This node stopped; {saved}. "
                f"Relaunch every node of the run with the same command (nodes {', '.join(self.nodes)}; the lost "
                f"one(s) on a healthy machine if theirs is gone): the job resumes from its newest complete version")


def newest_durable(log_path: Path) -> dict | None:
    """The ``commit`` event of the newest durable version in a run's event log, or None."""
    newest = None
    try:
        for e in read_events(log_path):
            if e.get("event") == "commit" and e.get("tier") == "durable" and (
                    newest is None or e.get("step", -1) > newest.get("step", -1)):
                newest = e
    except OSError:
        pass
    return newest


class ResilientAgent(SimpleElasticAgent):
    def __init__(self, spec: WorkerSpec, settings: AgentSettings, registry: NodeRegistry | None,
                 events: EventLog, exit_barrier_timeout: timedelta = timedelta(minutes=5)):
        super().__init__(spec, exit_barrier_timeout=exit_barrier_timeout.total_seconds())
        self.settings = settings
        self.registry = registry
        self.events = events
        self.pool = WarmPool(settings.spares, settings.worker_env, entry=settings.worker_entry,
                             preload=settings.worker_preload)
        # Heartbeat files live here; an agent killed with -9 leaves its dir behind, so the
        # next one on this machine removes those whose owner is gone.
        reclaim_dirs(tempfile.gettempdir(), "resilient-agent-")
        self._tmp = Path(tempfile.mkdtemp(prefix=f"resilient-agent-{settings.node_id}-"))
        (self._tmp / OWNER).write_text(owner_record())
        # A program that need not beat (a user's script) is watched for hangs only once it has.
        self.heartbeats = HeartbeatMonitor(self._tmp, settings.heartbeat_timeout,
                                           settings.startup_timeout if settings.worker_heartbeats else timedelta.max)
        self.procs: dict[int, WorkerProcess] = {}
        self.round_nodes: set[str] = set()
        self._next_membership_check = 0.0
        self._round = 0
        self._startup_failures = 0
        self._refill_pending = False
        self.quarantined = False
        self.stop_reason: str | None = None   # why run() ended, for the agent_stop event
        self._outside_signal: int | None = None  # the signal (SIGTERM, SIGINT) that ended run(), if one did
        self._etcd_down_since: float | None = None  # monotonic time of the first failed read of an outage
        self.etcd_gone = False                # at the end: etcd did not answer, its calls were skipped
        self.store = None
        if settings.store is not None and settings.etcd_factory is not None:
            from resilient.agent.store import NodeStoreService

            try:
                self.store = NodeStoreService(settings.store, settings.run_id, settings.node_id,
                                              settings.etcd_endpoint, settings.etcd_factory, self._tmp, events,
                                              settings.etcd_conf)
            except BaseException:  # e.g. another live agent owns the store: leave nothing behind
                self.pool.close()
                shutil.rmtree(self._tmp, ignore_errors=True)
                raise
        # Prometheus metrics from this node's events (resilient.agent.metrics), served from the
        # start of run(): they live here, so they outlive every worker restart.
        self.metrics = None
        if settings.metrics_port is not None:
            self.metrics = AgentMetrics(events_path(settings.run_dir), settings.node_id, settings.run_id,
                                        quarantined=QuarantineCount(settings.etcd_factory, settings.run_id, events)
                                        if settings.etcd_factory is not None else None)
            # The rendezvous' client sits in torch's handler (its private _store: our Etcd3Store).
            self.metrics.watch_etcd([registry.client if registry is not None else None,
                                     self.store.client if self.store is not None else None,
                                     getattr(getattr(spec.rdzv_handler, "_store", None), "client", None)])
        if registry is not None:
            info = self.store.registry_info() if self.store is not None else {}
            if hasattr(spec.rdzv_handler, "node_desc"):
                info["rdzv"] = spec.rdzv_handler.node_desc
            registry.update(**info)
        # fail-slow replace: whether a seat can be handed over; a slow node's mark and rejoin
        self.failslow = SeatHandover(node=settings.node_id, run_id=settings.run_id, run_dir=settings.run_dir,
                                     min_nodes=settings.min_nodes, cfg=settings.failslow,
                                     registry=registry, events=events, tmp=self._tmp)
        self.compactor = None  # started last: a failed start leaves no thread behind
        if registry is not None and settings.etcd_compact_interval > timedelta(0):
            self.compactor = HistoryCompactor(registry.client, settings.etcd_compact_interval,
                                              key=f"/resilient/{settings.run_id}/")
        # torch's loop (SimpleElasticAgent._invoke_run) asks the handler for waiting nodes at
        # every healthy check and ends run() on the first error; an etcd outage must instead be
        # ridden through for a while (see _nodes_waiting). The loop reads the handler through
        # the spec, so the bound method is shadowed on this handler instance.
        handler = spec.rdzv_handler
        self._handler_nodes_waiting = handler.num_nodes_waiting
        handler.num_nodes_waiting = self._nodes_waiting

    # -- the loop ---------------------------------------------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        # Join only once this node can start its workers at once: a node that joins
        # while still importing torch (10-30 s on a busy host) makes every member of
        # the round wait for it; the running job instead trains on until it is ready,
        # then admits it (one ~2 s restart). Without spares the cold processes at
        # least import while the rendezvous runs.
        try:
            if self.metrics is not None:
                address = self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
                self.events.emit("metrics", address=address)
                if self.registry is not None:  # where `resilient status` and service discovery find it
                    self.registry.update(metrics=address)
            self.failslow.wait_if_marked(self._worker_group.spec.rdzv_handler)   # marked slow: probe first
            self.pool.fill(self.settings.nproc_per_node)
            if not self.pool.wait_ready(self.settings.startup_timeout):
                log.warning("the warm worker template is not ready after %s; joining anyway",
                            self.settings.startup_timeout)
            result = super()._invoke_run(role)
        except SignalException as e:
            self.stop_reason = signal.Signals(e.sigval).name
            self._outside_signal = int(e.sigval)
            raise
        except EtcdOutage:
            self.stop_reason = "etcd_outage"
            raise
        except ControlPlaneLost:
            self.stop_reason = "control_plane_lost"
            raise
        except RendezvousGracefulExitError:
            self.stop_reason = "rendezvous_closed"
            raise
        except RendezvousError as e:
            self.stop_reason = f"rendezvous_failed: {type(e).__name__}: {e}"
            raise
        except Exception as e:  # torch's run() shuts down and re-raises
            self.stop_reason = f"error: {type(e).__name__}: {e}"
            raise
        if self.quarantined:
            self.stop_reason = "quarantined"
        elif result.state == WorkerState.SUCCEEDED:
            self.stop_reason = "finished"
        else:
            self.stop_reason = f"workers_{result.state.name.lower()}"
        return result

    def _nodes_waiting(self) -> int:
        """The handler's ``num_nodes_waiting``, riding through an etcd outage: while etcd is
        unreachable the workers train on (no node can join anyway) until ``etcd_outage``
        has passed since the first failed read; then :class:`EtcdOutage` ends the run."""
        started = time.monotonic()
        if self.failslow.leaving():   # this node's workers are handing their seat over (fail-slow)
            return 0
        try:
            waiting = self._handler_nodes_waiting()
        except RendezvousUnavailable as e:
            self._raise_if_control_plane_lost(e)
            if self._etcd_down_since is None:
                self._etcd_down_since = started
                log.warning("etcd at %s is unreachable; the workers train on, and this node stops if it "
                            "stays so for %s (launch.etcd_outage): %s", self.settings.etcd_endpoint,
                            self.settings.etcd_outage, e)
            down = timedelta(seconds=time.monotonic() - self._etcd_down_since)
            if down >= self.settings.etcd_outage:
                raise EtcdOutage(self.settings.etcd_endpoint, down, self.settings.etcd_outage,
                                 self.settings.run_dir) from e
            return 0
        if self._etcd_down_since is not None:
            log.warning("etcd at %s answers again after %.0f s", self.settings.etcd_endpoint,
                        time.monotonic() - self._etcd_down_since)
            self._etcd_down_since = None
        # A worker of this node is leaving to have the node quarantined (its device is bad):
        # the others left at the same barrier and may already wait in the next round, but a
        # restart now would kill the worker before its WorkerExit.QUARANTINE is seen, and this node
        # would join that round and corrupt again. Let it exit; _monitor_workers quarantines.
        # Read after the waiting count: a node waits only after that barrier, which this
        # worker reaches after its mark.
        if waiting and any(self.heartbeats.quarantine_marked(r) for r in self.procs):
            return 0
        return waiting

    # -- rendezvous -----------------------------------------------------------
    def _raise_if_control_plane_lost(self, cause: BaseException | None = None) -> None:
        """:class:`ControlPlaneLost` when etcd does not answer and members of this round are
        certainly gone: an outage of an etcd whose nodes live is ridden through (bounded by
        ``etcd_outage``), but one that left with its nodes never comes back."""
        if self.registry is None:
            return
        members = len(self.registry.client.endpoints)
        if self._etcd_answers(CLUSTER_CONTROL_PLANE_CHECK if members > 1 else CONTROL_PLANE_CHECK):
            return
        lost = self.registry.gone_for_sure(self.round_nodes)
        if lost:
            raise ControlPlaneLost(self.settings.etcd_endpoint, sorted(lost), sorted(self.round_nodes),
                                   self.settings.run_dir) from cause

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        t0 = time.monotonic()
        if self._round:   # a re-form: its workers failed; with the control plane gone, no round will come
            self._raise_if_control_plane_lost()
        for attempt in range(1, MAX_LOST_ROUNDS + 1):
            self._evict_dead_members(worker_group)
            try:
                self._join_round(worker_group)
                break
            except RendezvousUnavailable as e:
                # etcd left while this node joined: the owner of the embedded one was preempted
                # (SIGTERM) and, its wait for the others over, took etcd with it. Say so, typed.
                self._raise_if_control_plane_lost(e)
                raise
            except RendezvousRoundLost as e:
                # A member of the round just completed died before its workers could
                # start: join the next round now instead of waiting out the store timeout.
                log.warning("rendezvous round lost (attempt %d): %s", attempt, e)
                self.events.emit("failure", kind=FailureKind.ROUND_LOST.value, attempt=attempt, reason=str(e))
                if attempt == MAX_LOST_ROUNDS:
                    raise
        self._round += 1
        self.events.emit("rendezvous", round=self._round, group_rank=worker_group.group_rank,
                         nodes=sorted(self.round_nodes), world=worker_group.workers[0].world_size,
                         seconds=time.monotonic() - t0)

    def _evict_dead_members(self, worker_group: WorkerGroup) -> None:
        handler = worker_group.spec.rdzv_handler
        if self.registry is None or not hasattr(handler, "evict"):
            return
        try:
            dead = handler.evict(self.registry.proven_dead)
        except Exception as e:  # an optimization: the keep-alive expiry still evicts them
            log.warning("could not evict dead members from the rendezvous: %s", e)
            return
        if dead:
            self.events.emit("evicted", nodes=dead, reason="agent port refuses connections")

    def _join_round(self, worker_group: WorkerGroup) -> None:
        with JoinProgress(self.settings, self.registry):
            super()._rendezvous(worker_group)
        # Publish who we are in this round's store, learn who the others are.
        ids = exchange_node_ids(worker_group.store, worker_group.group_rank,
                                worker_group.group_world_size, self.settings.node_id)
        self.round_nodes = set(ids)
        by_rank = getattr(worker_group.spec.rdzv_handler, "members_by_rank", None)
        if self.registry is not None and by_rank is not None:  # proven_dead's names, without a full read
            self.registry.know_round(by_rank(), ids)

    # -- workers ----------------------------------------------------------------
    def _worker_env(self, wg: WorkerGroup, worker) -> dict[str, str]:
        spec = wg.spec
        restarts = spec.max_restarts - self._remaining_restarts
        return {
            # The whole worker environment, not only what differs per worker: a zygote started
            # before the config was read (warm.start_early) lacks the thread count.
            **self.settings.worker_env,
            "LOCAL_RANK": str(worker.local_rank), "RANK": str(worker.global_rank),
            "GROUP_RANK": str(wg.group_rank), "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role, "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size), "GROUP_WORLD_SIZE": str(wg.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": wg.master_addr, "MASTER_PORT": str(wg.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(), "TORCHELASTIC_USE_AGENT_STORE": "False",
            ROUND_ENV: str(self._round),
            RUN_DIR_ENV: str(Path(self.settings.run_dir).resolve()), NODE_ID_ENV: self.settings.node_id,
            **({RUNTIME_CONFIG_ENV: self.settings.runtime_config} if self.settings.runtime_config else {}),
            HEARTBEAT_ENV: self.heartbeats.path(worker.local_rank),
            **(self.store.env() if self.store is not None else {}),
            **self.failslow.env(),
        }

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, int]:
        warm = 0
        if self.store is not None:   # before they start: every version in the store now is older workers'
            self.store.set_workers({w.global_rank for w in worker_group.workers}, worker_group.workers[0].world_size)
        for worker in worker_group.workers:
            wp, was_warm = self.pool.take()
            warm += was_warm
            self.heartbeats.reset(worker.local_rank)
            wp.assign(self._worker_env(worker_group, worker), self.settings.worker_argv)
            self.procs[worker.local_rank] = wp
        # Spares are refilled once these workers have beaten (see _refill_when_running): new
        # spares importing torch next to workers that are still starting would slow them down.
        self._refill_pending = True
        self.events.emit("workers_started", round=self._round, local_ranks=sorted(self.procs),
                         warm=warm, pids=[p.pid for p in self.procs.values()])
        return {r: p.pid for r, p in self.procs.items()}

    def _stop_workers(self, worker_group: WorkerGroup, sig: int = signal.SIGKILL,
                      grace: timedelta = timedelta(seconds=0)) -> None:
        # A restart kills at once: state worth keeping is in the snapshot store
        # already, and every second spent here is recovery time.
        for wp in self.procs.values():
            wp.kill(sig)
        deadline = time.monotonic() + grace.total_seconds()
        for wp in self.procs.values():
            left = max(0.0, deadline - time.monotonic())
            if sig != signal.SIGKILL and wp.wait(timedelta(seconds=left)) is None:
                wp.kill(signal.SIGKILL)
            wp.wait(timedelta(seconds=10))
        self.procs.clear()

    def give_up_reason(self, result: RunResult) -> str:
        """Why the agent gave up on a failed run, for the launcher's error: which limit was
        hit, the exit code, and the root cause the node's workers logged (the earliest
        ``worker_error`` of the last attempt: later ones are usually its echo, e.g. a
        peer's connection reset)."""
        first = next(iter(result.failures.values()), None)
        code = f"local rank {first.local_rank} exit code {first.exitcode}" if first else "no exit code"
        if any(f.exitcode == WorkerExit.NOT_DURABLE for f in result.failures.values()):
            why = f"the final state could not be made durable ({code}); a restart would not mend it"
        elif self._startup_failures >= MAX_STARTUP_FAILURES:
            why = f"the workers failed {self._startup_failures} times in a row before their first step ({code})"
        else:
            why = f"{self.settings.max_restarts} restarts used up ({code})"
        log_path = events_path(self.settings.run_dir)
        errors: list[dict] = []
        try:
            for e in read_events(log_path):
                if e.get("node") != self.settings.node_id:
                    continue
                if e.get("event") == "workers_started":
                    errors = []
                elif e.get("event") == "worker_error":
                    errors.append(e)
        except OSError:
            pass
        return why + (f"; rank {errors[0].get('rank')} said: {errors[0].get('error')}" if errors else "")

    def _failure(self, wg: WorkerGroup, local_rank: int, wp: WorkerProcess, exitcode: int) -> dict:
        """torch's RunResult keys failures by global rank."""
        worker = wg.workers[local_rank]
        return {worker.global_rank: ProcessFailure(local_rank=local_rank, pid=wp.pid, exitcode=exitcode, error_file="")}

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        failures = {}
        for local_rank, wp in self.procs.items():
            code = wp.poll()
            if code is not None and code != 0:
                failures.update(self._failure(worker_group, local_rank, wp, code))
                if code not in (WorkerExit.PEER_LEFT, WorkerExit.SLOW):
                    self.events.emit("failure", kind=FailureKind.EXIT.value, local_rank=local_rank,
                                     pid=wp.pid, exitcode=code)
        if failures and all(f.exitcode in (WorkerExit.PEER_LEFT, WorkerExit.SLOW) for f in failures.values()):
            # Another node was preempted (or found slow); every rank stopped after the same step
            # and saved it. Once this node's workers are all out (the others may still be
            # saving), re-form without the leaver: not a failure, no restart counted.
            if any(wp.poll() is None for wp in self.procs.values()):
                return RunResult(state=WorkerState.HEALTHY)
            slow = sorted(f.local_rank for f in failures.values() if f.exitcode == WorkerExit.SLOW)
            if slow:   # this node is the slow one: mark it, leave the round, rejoin when healthy
                self.failslow.hand_over(slow, self._leave_rendezvous, worker_group.spec.rdzv_handler)
            self.events.emit("membership", reason="peer_preempted", nodes_before=sorted(self.round_nodes))
            self._restart_workers(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if failures:
            self._count_startup_failures(failures)
            self._quarantine_if_asked(failures)
            if any(f.exitcode == WorkerExit.NOT_DURABLE for f in failures.values()):
                self._remaining_restarts = 0  # see WorkerExit.NOT_DURABLE
            return RunResult(state=WorkerState.FAILED, failures=failures)
        if all(wp.poll() == 0 for wp in self.procs.values()):
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in worker_group.workers})
        for local_rank, wp in self.procs.items():
            silent = self.heartbeats.silent_for(local_rank) if wp.poll() is None else None
            if silent is not None:
                self.events.emit("heartbeat_timeout", local_rank=local_rank, pid=wp.pid,
                                 seconds_since_beat=silent[0], timeout=silent[1])
                self.events.emit("failure", kind=FailureKind.HANG.value, local_rank=local_rank, pid=wp.pid)
                failure = self._failure(worker_group, local_rank, wp, -signal.SIGKILL)
                self._quarantine_if_asked(failure)   # stuck on its way out to quarantine: still quarantined
                return RunResult(state=WorkerState.FAILED if self.quarantined else WorkerState.UNHEALTHY,
                                 failures=failure)
        self._refill_when_running()
        self._check_membership(worker_group)
        self.failslow.publish(self.round_nodes)
        if self.store is not None:
            self.store.report_full()
        return RunResult(state=WorkerState.HEALTHY)

    def _refill_when_running(self) -> None:
        """Warm new spares once every worker has sent its first heartbeat (it is training):
        spares spawned while the workers still start would import torch next to them, and
        on a busy host every process would reach its first step later."""
        if self._refill_pending and all(os.path.exists(self.heartbeats.path(r)) for r in self.procs):
            self._refill_pending = False
            self.pool.refill_later(timedelta(0))

    def _quarantine_if_asked(self, failures: dict) -> None:
        """A worker that exits with WorkerExit.QUARANTINE sits on a device the SDC
        monitor confirmed bad: record this node as quarantined in etcd and
        stop (no restart here); the other nodes re-form without it."""
        # The worker's mark (HeartbeatWriter.mark_quarantine) is the verdict too: the node's other
        # workers exit 1 at the same barrier and may be seen first; a restart would kill the bad one.
        bad = sorted({f.local_rank for f in failures.values() if f.exitcode == WorkerExit.QUARANTINE}
                     | {r for r in self.procs if self.heartbeats.quarantine_marked(r)})
        if not bad:
            return
        self.quarantined = True
        self._remaining_restarts = 0
        record = {"reason": "silent data corruption confirmed by the SDC monitor",
                  "local_ranks": bad, "device": f"{self.settings.node_id}:{bad[0]}"}
        try:
            # in etcd and where a relaunch finds it (resilient.ledger): it outlives the etcd
            Quarantine(self.registry.client if self.registry is not None else None, self.settings.run_id,
                       copies=run_copies(self.settings.run_dir, self.settings.durable_url)).add(
                self.settings.node_id, **record)
        except Exception as e:  # still leave: a bad node must not keep training
            log.error("could not record the quarantine: %s", e)
        self.events.emit("quarantine", node=self.settings.node_id, **record)

    def _count_startup_failures(self, failures: dict) -> None:
        """A worker that dies before its first heartbeat (a config or data
        error, an import failure) will die the same way next time: after
        ``MAX_STARTUP_FAILURES`` in a row, stop restarting and fail the job
        with the worker's error instead of looping through max_restarts."""
        before_first_beat = self.settings.worker_heartbeats and any(  # a script that never beats: see AgentSettings
            not os.path.exists(self.heartbeats.path(f.local_rank)) for f in failures.values())
        self._startup_failures = self._startup_failures + 1 if before_first_beat else 0
        if self._startup_failures >= MAX_STARTUP_FAILURES:
            log.error("workers failed %d times in a row before their first step; giving up", self._startup_failures)
            self._remaining_restarts = 0

    def _check_membership(self, worker_group: WorkerGroup) -> None:
        """Restart now if a node of this round is gone (not counted as a failure:
        losing nodes is what preemptible fleets do)."""
        now = time.monotonic()
        if self.registry is None or now < self._next_membership_check:
            return
        self._next_membership_check = now + self.settings.lease_ttl.total_seconds() / 3
        lost = self.registry.lost(self.round_nodes - {self.settings.node_id}, neighbours=3)
        if lost:
            self.events.emit("failure", kind=FailureKind.NODE_LOST.value, nodes=sorted(lost))
            self.events.emit("membership", nodes_before=sorted(self.round_nodes),
                             nodes_after=sorted(self.round_nodes - lost))
            self._restart_workers(worker_group)

    # -- the end -----------------------------------------------------------------
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # A SIGTERM from outside while workers still run is a preemption notice. torch's run()
        # also calls this with its default SIGTERM when the loop ends, on success and on an
        # error (an etcd outage, a rendezvous failure): that stop is ours, not a preemption.
        running = any(p.poll() is None for p in self.procs.values())
        outside = self._outside_signal is not None
        # Ctrl-C (SIGINT) takes the same path: the user wants the job stopped, not its
        # newest steps lost (the workers would die mid-step with a KeyboardInterrupt).
        preempted = outside and death_sig in (signal.SIGTERM, signal.SIGINT) and running
        # At the end, a dead etcd (the owner of an embedded one left first, an outage) is
        # asked once, briefly: each call below would otherwise retry for the client's budget.
        self.etcd_gone = self.etcd_gone or (self.registry is not None and not self._etcd_answers())
        if preempted:
            ignore_stop_signals()  # a second Ctrl-C must not abandon the workers half-way
            self.events.emit("preemption", signal=int(death_sig),
                             grace_seconds=self.settings.preemption_grace.total_seconds())
        if running and death_sig in (signal.SIGTERM, signal.SIGINT):
            # Preempted or stopped by our own decision: the workers finish the step and save.
            if not preempted:   # ours: they must not call it a preemption
                self.heartbeats.announce_stop(self.stop_reason or "stopped by its agent")
            self._stop_workers(self._worker_group, signal.SIGTERM, self.settings.preemption_grace)
            if self.store is not None and not self.etcd_gone:
                # The newest version must survive this node: replicate it before leaving.
                self.store.flush(timedelta(seconds=10))
            if not self.etcd_gone:
                self._leave_rendezvous()
        else:
            self._stop_workers(self._worker_group, death_sig, timedelta(seconds=timeout))
        self.pool.close()
        if self.store is not None and self.stop_reason == "control_plane_lost":
            # The committed versions' records left with etcd: make the newest whole one durable
            # (the workers, dead with their peer, could not), as an etcd-outage stop does.
            url = self.settings.durable_url or (Path(self.settings.run_dir) / "checkpoints").as_uri()
            step = self.store.make_durable(url)
            log.warning("the control plane is gone: %s", f"made step {step} durable at {url}" if step is not None
                        else "no whole version in this node's store to make durable")
        if self.store is not None:  # kept for a relaunch while the run is unfinished (issue 38)
            self.store.close(self.stop_reason)
        if self.compactor is not None:
            self.compactor.close()
        # The node registry is left last, in leave(): see there.
        shutil.rmtree(self._tmp, ignore_errors=True)
        if preempted:
            reason = "preempted" if death_sig == signal.SIGTERM else "interrupted"
        elif outside and running:
            reason = signal.Signals(death_sig).name
        else:
            # run() ends here on success and on every error: say which, not "finished" for all.
            reason = self.stop_reason or "error: the agent loop ended without a result"
        self.events.emit("agent_stop", reason=reason)
        if self.metrics is not None:
            self.metrics.close()

    def leave(self, close_rendezvous: bool) -> None:
        """This node's last etcd calls, after ``run()``: close the rendezvous for every node
        (the job succeeded) and then, last of all, leave the node registry.

        The order matters: the owner of an embedded etcd stops it once no other agent is
        in the registry (:func:`resilient.launch.wait_for_agents_to_leave`). A call made
        after leaving would meet a dead etcd and retry for the client's whole budget: the
        process would hang on its way out."""
        handler = self._worker_group.spec.rdzv_handler
        try:
            if close_rendezvous and not self.etcd_gone:
                handler.shutdown()
            elif hasattr(handler, "_stop_heartbeats"):
                handler._stop_heartbeats()  # torch's keep-alive thread would go on after we left
        except Exception as e:  # the others see the round end by their own keep-alives
            log.warning("could not close the rendezvous: %s", e)
        if self.registry is None:
            return
        if self.etcd_gone:
            self.registry.lease.close(revoke=False)  # it lapses on its own, if etcd ever comes back
        else:
            self.registry.leave()

    def _exit_barrier(self) -> None:
        """torch's exit barrier (every agent waits for the others' workers to finish), without
        its traceback for the two ends of it that are no error once this node's workers
        succeeded: a member stopped sending keep-alives (it is gone: nobody to wait for), or
        etcd is gone (the owner of the embedded one left first: nobody to wait with)."""
        import torch.distributed.elastic.utils.store as store_util
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID

        if self.registry is not None and not self._etcd_answers():
            self.etcd_gone = True
            return
        self._in_exit_barrier = True
        try:
            store_util.barrier(store=self._store, world_size=self._worker_group.group_world_size,
                               key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=self._exit_barrier_timeout)
        except (RendezvousRoundLost, RendezvousUnavailable) as e:
            log.info("not waiting for the other agents at the end: %s", e)
        except SignalException:
            raise
        except Exception as e:  # as torch's: the workers succeeded, the node goes on leaving
            log.warning("the exit barrier with the other agents failed: %s", e)
        finally:
            self._in_exit_barrier = False

    def _etcd_answers(self, timeout: timedelta = timedelta(seconds=1)) -> bool:
        try:
            self.registry.client.check(timeout)
            return True
        except EtcdError:
            log.info("etcd at %s does not answer at exit; skipping the calls to it", self.settings.etcd_endpoint)
            return False

    def _leave_rendezvous(self) -> None:
        """Take this node out of the round's participants now.

        torch's handler only leaves a round as the first step of joining the
        next one (its "exit" operation), and its ``shutdown()`` closes the
        rendezvous for every node. A preempted node must do the former alone,
        so the survivors re-form without waiting for its keep-alive to lapse.
        """
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler = self._worker_group.spec.rdzv_handler
        try:
            if hasattr(handler, "leave"):  # the keyed handler (resilient.rendezvous.keyed)
                handler.leave()
                return
            handler._stop_heartbeats()
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10.0)
        except Exception as e:  # best effort: the keep-alive expiry is the fallback
            log.warning("could not leave the rendezvous cleanly: %s", e)


class JoinProgress:
    """While a rendezvous join waits, say every ``join_progress_interval`` who is there: the
    nodes registered now, how many the job needs, the endpoint. A join waits up to
    ``join_timeout`` (10 minutes by default) for missing nodes; silence for that long reads as a
    hang (issue 38). A context manager: the thread stops when the join returns or raises."""

    def __init__(self, settings: AgentSettings, registry: NodeRegistry | None) -> None:
        self.settings, self.registry = settings, registry
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="join-progress", daemon=True)
        self.said = 0

    def __enter__(self) -> "JoinProgress":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def line(self) -> str:
        s = self.settings
        try:  # unknown is said as unknown: the registry's read may fail while etcd is away
            alive = self.registry.alive() if self.registry is not None else None
        except Exception:
            alive = None
        there = ("etcd cannot say which nodes are registered" if alive is None else
                 f"nodes registered now: {', '.join(sorted(set(alive) | {s.node_id}))} (this one: {s.node_id})")
        need = f"{s.min_nodes}" if s.min_nodes == s.max_nodes else f"at least {s.min_nodes} (up to {s.max_nodes})"
        return (f"resilient: node {s.node_id} has waited {time.monotonic() - self._t0:.0f} s for the rendezvous at "
                f"{s.etcd_endpoint or 'the rendezvous endpoint'}: {there}; the job needs {need} node(s); it gives up "
                f"after launch.join_timeout ({s.join_timeout.total_seconds():.0f} s). Start the missing nodes "
                "on this run dir and endpoint")

    def _run(self) -> None:
        every = self.settings.join_progress_interval.total_seconds()
        while not self._done.wait(every):
            log.warning("%s", self.line())
            self.said += 1
