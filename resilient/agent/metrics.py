"""Prometheus metrics of one agent, made from its node's lines of the event log.

Every agent serves ``/metrics`` over HTTP (``launch.metrics_port``, on
``launch.metrics_host``: loopback by default, ``0.0.0.0`` for a scraper on another
machine; the bound address is the ``metrics`` event and the ``metrics`` field of
the node's entry in the etcd node registry). The page names the node, the run id,
the step and the failure and auth-failure counts: not a secret, but nothing for the
network by default; any local user can read it. The numbers come from the run's JSON-lines event
log (:mod:`resilient.events`), not from a new channel to the workers: the log
already says everything an operator asks (steps, snapshots, commits, restores,
failures, rounds, SDC verdicts), workers need no change, and what the agent
reads survives every worker restart, because the agent does.

The log is read when Prometheus asks: each scrape first reads the lines added
since the previous one (those of this node, ``node`` = the agent's node id), so
an agent nobody scrapes does no work, and a scrape sees every event written
before it. Reading starts where the log ended when the agent started: counters
start at zero with the agent, as Prometheus expects of a process.

On a fleet each node has its own run dir, hence its own log; where nodes share
one (several agents on one machine, a shared file system) each agent still
counts only its node's lines. Events written once per job (a commit, an SDC
verdict) are counted by the agent of the node that wrote them: aggregate with
``max``/``sum`` over the agents (``max by (tier) (resilient_committed_step)``).

Each agent has a registry of its own (no process-global state): several agents
in one process never share a series. etcd request latency is measured in the
agent's etcd clients (:attr:`resilient.etcd.EtcdClient.on_request`), the
quarantined nodes are read from etcd (their records are the truth, and a
quarantined node's own agent has left), at most every ``quarantine_every``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.registry import Collector

from resilient.errors import LaunchError

log = logging.getLogger(__name__)

__all__ = ["AgentMetrics", "EventFollower", "MetricsPortInUse", "QuarantineCount"]

# Buckets: seconds from a millisecond (a snapshot capture, an etcd read) to minutes (a
# durable restore of a big model); bytes from 64 KiB to 64 GiB by fours.
_FAST_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_BYTES = tuple(float(1 << b) for b in range(16, 37, 2))
_CHUNK = 4 << 20  # bytes of the log read at a time


class MetricsPortInUse(LaunchError):
    """``launch.metrics_port`` is taken on this machine."""


def _number(value: Any) -> float | None:
    """A finite number of an event field, else None (the log writes NaN as a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class EventFollower:
    """Reads the lines a JSON-lines log gains, those of one node.

    Starts at the log's current end (or its start, if it does not exist yet). A
    line not yet ended by a newline (a writer mid-``write``) is left for the next
    read; a log that shrank or was replaced is read again from its start."""

    def __init__(self, path: str | os.PathLike, node: str):
        self.path = Path(path)
        self.node = node
        try:
            st = self.path.stat()
            self._offset, self._inode = st.st_size, st.st_ino
        except FileNotFoundError:
            self._offset, self._inode = 0, None

    def new_events(self) -> Iterator[dict]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._inode or st.st_size < self._offset:
                self._offset, self._inode = 0, st.st_ino
            f.seek(self._offset)
            rest = b""
            # In chunks: after hours without a scrape the backlog may be large.
            while chunk := f.read(_CHUNK):
                data = rest + chunk
                end = data.rfind(b"\n") + 1
                rest = data[end:]
                self._offset += end
                for line in data[:end].splitlines():
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:  # a torn line of a writer killed mid-write
                        continue
                    if isinstance(event, dict) and event.get("node") == self.node:
                        yield event


class QuarantineCount:
    """The number of quarantined nodes of a run, from their records in etcd.

    A client of its own that gives up after ``give_up``: a scrape during an etcd
    outage must answer (Prometheus times a scrape out after 10 s), not retry for
    the agent's whole budget. Only authentic records count (a forged one is
    reported as an ``auth_failure`` and ignored, as by the agent)."""

    def __init__(self, client_factory: Callable[[], Any], run_id: str, events: Any = None,
                 give_up: timedelta = timedelta(seconds=1)):
        self._factory, self._run_id, self._events, self._give_up = client_factory, run_id, events, give_up
        self.client = None

    def __call__(self) -> int:
        from resilient.agent.quarantine import Quarantine  # the agent's records; imported when first read

        if self.client is None:
            self.client = self._factory()
            self.client.retry_timeout = self._give_up
        return len(Quarantine(self.client, self._run_id, events=self._events).all())

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class AgentMetrics(Collector):
    """The metrics of one agent: a :class:`CollectorRegistry` of their own, filled from the
    node's events (:meth:`observe`) and the agent's etcd requests (:meth:`etcd_request`).

    ``quarantined``: returns the number of quarantined nodes (:class:`QuarantineCount`);
    asked at a scrape, at most every ``quarantine_every``; None: not exported."""

    def __init__(self, log_path: str | os.PathLike, node: str, run_id: str = "",
                 quarantined: Callable[[], int] | None = None,
                 quarantine_every: timedelta = timedelta(seconds=10)):
        self.follower = EventFollower(log_path, node)
        self._quarantined = quarantined
        self._quarantine_every = quarantine_every.total_seconds()
        self._quarantine_read = -math.inf
        self._lock = threading.Lock()
        self._server = None
        self._thread = None
        self._down: tuple[str, float] | None = None  # (kind, time) of the failure being recovered from
        self._restarted = False                      # workers started since that failure
        m: list = []

        def add(metric):
            m.append(metric)
            return metric

        self.info = add(Gauge("resilient_agent_info", "1, labelled with the agent's node id and run id",
                              ["node", "run_id"], registry=None))
        self.info.labels(node, run_id).set(1)
        self.events = add(Counter("resilient_events", "events this node wrote to the run's log, by kind",
                                  ["event"], registry=None))
        self.step = add(Gauge("resilient_training_step", "the newest step the node's workers completed",
                              registry=None))
        self.tokens = add(Gauge("resilient_training_tokens_per_second",
                                "training throughput the node's workers last reported (the built-in GPT: "
                                "the global batch's tokens per second, the same on every node)", registry=None))
        self.committed = add(Gauge("resilient_committed_step",
                                   "the newest step committed at a tier (local, peer, durable) by this node",
                                   ["tier"], registry=None))
        self.blocked = add(Histogram("resilient_snapshot_blocked_seconds",
                                     "training time a rank was blocked by a snapshot capture",
                                     registry=None, buckets=_FAST_S))
        self.snapshot_bytes = add(Histogram("resilient_snapshot_size_bytes",
                                            "bytes of a rank's snapshot (its host buffer)",
                                            registry=None, buckets=_BYTES))
        self.restore = add(Histogram("resilient_restore_duration_seconds",
                                     "a rank's restore, by the tier that served it",
                                     ["tier"], registry=None, buckets=_SLOW_S))
        self.failures = add(Counter("resilient_failures", "failures seen by this node, by kind (exit, hang, "
                                    "node_lost, round_lost, ...)", ["kind"], registry=None))
        self.recoveries = add(Counter("resilient_recoveries", "recoveries: the node's workers trained again "
                                      "after a failure, by the kind of the failure", ["kind"], registry=None))
        self.recovery = add(Histogram("resilient_recovery_duration_seconds",
                                      "from a failure to the node's first step after its workers restarted",
                                      ["kind"], registry=None, buckets=_SLOW_S))
        self.rounds = add(Counter("resilient_rendezvous_rounds", "rendezvous rounds this node completed",
                                  registry=None))
        self.round = add(Gauge("resilient_rendezvous_round", "this agent's newest rendezvous round",
                               registry=None))
        self.members = add(Gauge("resilient_rendezvous_members", "nodes in the newest round", registry=None))
        self.world = add(Gauge("resilient_world_size", "worker processes in the newest round", registry=None))
        self.round_s = add(Histogram("resilient_rendezvous_duration_seconds", "time to complete a round",
                                     registry=None, buckets=_SLOW_S))
        self.suspects = add(Counter("resilient_sdc_suspicions", "silent-data-corruption suspicions, by kind",
                                    ["kind"], registry=None))
        self.verdicts = add(Counter("resilient_sdc_verdicts", "verdicts on SDC suspicions (false_alarm, "
                                    "transient, persistent, harmless)", ["verdict"], registry=None))
        self.rollbacks = add(Counter("resilient_sdc_rollbacks", "rollbacks to the last clean version",
                                     registry=None))
        self.quarantined = add(Gauge("resilient_quarantined_nodes", "nodes of the run quarantined in etcd",
                                     registry=None)) if quarantined is not None else None
        self.stragglers = add(Counter("resilient_stragglers", "straggler reports, by cause", ["cause"],
                                      registry=None))
        self.straggler = add(Gauge("resilient_straggler_factor",
                                   "the step slowdown (>= 1) last reported for a straggling node "
                                   "(unlocated: a slow link not yet pinned to a node)",
                                   ["slow_node"], registry=None))
        self.etcd = add(Histogram("resilient_etcd_request_duration_seconds",
                                  "one HTTP request of the agent to etcd, by gateway path (/kv/range, "
                                  "/kv/txn, /lease/keepalive, ...)", ["op"], registry=None, buckets=_FAST_S))
        self._metrics = tuple(m)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- events -> metrics -----------------------------------------------------------
    def observe(self, e: dict) -> None:
        """Count one event of this node."""
        kind = e.get("event")
        if not isinstance(kind, str):
            return
        self.events.labels(kind).inc()
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(e)

    def _on_step(self, e: dict) -> None:
        if (step := _number(e.get("step"))) is not None:
            self.step.set(step)
        if (tps := _number(e.get("tokens_per_s"))) is not None:
            self.tokens.set(tps)
        if self._down is not None and self._restarted:
            kind, since = self._down
            self._down = None
            self.recoveries.labels(kind).inc()
            if (t := _number(e.get("time"))) is not None:
                self.recovery.labels(kind).observe(max(0.0, t - since))

    def _on_snapshot(self, e: dict) -> None:
        if (s := _number(e.get("blocked_s"))) is not None:
            self.blocked.observe(s)
        if (b := _number(e.get("bytes"))) is not None:
            self.snapshot_bytes.observe(b)

    def _on_commit(self, e: dict) -> None:
        if (step := _number(e.get("step"))) is not None:
            self.committed.labels(str(e.get("tier"))).set(step)

    def _on_restore(self, e: dict) -> None:
        if (s := _number(e.get("seconds"))) is not None:
            self.restore.labels(str(e.get("tier"))).observe(s)

    def _on_failure(self, e: dict) -> None:
        kind = str(e.get("kind"))
        self.failures.labels(kind).inc()
        if self._down is None:  # a recovery is timed from the first failure it mends
            self._down = (kind, _number(e.get("time")) or 0.0)
        self._restarted = False

    def _on_workers_started(self, e: dict) -> None:
        self._restarted = True

    def _on_rendezvous(self, e: dict) -> None:
        self.rounds.inc()
        if (r := _number(e.get("round"))) is not None:
            self.round.set(r)
        if isinstance(e.get("nodes"), list):
            self.members.set(len(e["nodes"]))
        if (w := _number(e.get("world"))) is not None:
            self.world.set(w)
        if (s := _number(e.get("seconds"))) is not None:
            self.round_s.observe(s)

    def _on_sdc_suspect(self, e: dict) -> None:
        self.suspects.labels(str(e.get("kind"))).inc()

    def _on_sdc_verdict(self, e: dict) -> None:
        self.verdicts.labels(str(e.get("verdict"))).inc()

    def _on_rollback(self, e: dict) -> None:
        self.rollbacks.inc()

    def _on_straggler(self, e: dict) -> None:
        self.stragglers.labels(str(e.get("cause"))).inc()
        if (f := _number(e.get("factor"))) is not None:
            self.straggler.labels(str(e.get("slow_node") or "unlocated")).set(f)

    def etcd_request(self, op: str, seconds: float) -> None:
        """:attr:`EtcdClient.on_request`: one request to etcd took ``seconds``."""
        self.etcd.labels(op).observe(seconds)

    def watch_etcd(self, clients: Iterable[Any]) -> None:
        """Time every request of these etcd clients (None entries are skipped)."""
        for client in clients:
            if client is not None:
                client.on_request = self.etcd_request

    # -- the collector ---------------------------------------------------------------
    def catch_up(self) -> None:
        """Count the events written since the last call, and refresh the quarantine count."""
        with self._lock:
            for e in self.follower.new_events():
                self.observe(e)
            now = time.monotonic()
            if self._quarantined is not None and now - self._quarantine_read >= self._quarantine_every:
                self._quarantine_read = now
                try:
                    self.quarantined.set(self._quarantined())
                except Exception as ex:  # etcd away: the last value stands
                    log.debug("could not read the quarantined nodes for the metrics: %s", ex)

    def describe(self):
        for metric in self._metrics:
            yield from metric.describe()

    def collect(self):
        self.catch_up()
        for metric in self._metrics:
            yield from metric.collect()

    # -- serving ---------------------------------------------------------------------
    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns ``HOST:PORT`` to scrape,
        the host as the node's peers reach it (as the node store's peer server advertises).
        Loopback by default (``launch.metrics_host``: why, in :class:`~resilient.runconfig.LaunchConfig`)."""
        from resilient.snapshot.peer import _default_host

        try:
            self._server, self._thread = start_wsgi_server(port, host, registry=self.registry)
        except OSError as e:
            raise MetricsPortInUse(
                f"cannot serve metrics on {host}:{port} (launch.metrics_port): {e.strerror or e}; pick a free "
                "port, 0 for any free one (the address is in the run's `metrics` event), or -1 to turn "
                "metrics off") from None
        return f"{_default_host(host)}:{self._server.server_port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None
        if isinstance(self._quarantined, QuarantineCount):
            self._quarantined.close()
