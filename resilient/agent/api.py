"""Types shared by the agent's parts: settings, failures and typed errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from resilient.contract import SCRIPT_ENTRY
from resilient.errors import ResilientError
from resilient.failslow.api import FailSlowConfig


class AgentError(ResilientError):
    """The agent cannot run the job (bad --nnodes, no rendezvous, ...)."""


class NodeIdInUse(AgentError):
    """Another live agent of this run already holds this node id."""


class FailureKind(str, enum.Enum):
    """Why a worker group stopped being healthy.

    EXIT       a worker exited non-zero (exception, kill -9, OOM kill)
    HANG       a worker sent no heartbeat within the timeout (SIGSTOP, deadlock)
    NODE_LOST  another node of the round lost its liveness lease
    ROUND_LOST a member of a just-completed rendezvous round died before the
               workers started; the agent joins the next round
    """

    EXIT = "exit"
    HANG = "hang"
    NODE_LOST = "node_lost"
    ROUND_LOST = "round_lost"


@dataclass
class AgentSettings:
    """What one agent needs to know beyond the worker spec. Every timeout a timedelta."""

    node_id: str
    run_dir: str
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    spares: int = 0                     # warm processes kept beyond the running workers
    max_restarts: int = 3
    domain: str = ""                    # failure domain label (rack, zone)
    monitor_interval: timedelta = timedelta(seconds=0.1)
    heartbeat_timeout: timedelta = timedelta(seconds=30)
    startup_timeout: timedelta = timedelta(minutes=5)
    lease_ttl: timedelta = timedelta(seconds=3)
    preemption_grace: timedelta = timedelta(seconds=20)
    etcd_compact_interval: timedelta = timedelta(minutes=5)  # zero: never (resilient.etcd.compactor)
    etcd_outage: timedelta = timedelta(minutes=5)  # etcd unreachable this long: the node stops (ResilientAgent)
    join_timeout: timedelta = timedelta(minutes=10)  # the rendezvous handler's own bound, named in the progress line
    join_progress_interval: timedelta = timedelta(seconds=30)  # a waiting join says who is there this often
    run_id: str = ""
    etcd_endpoint: str = ""
    etcd_factory: Any = None            # () -> EtcdClient, for the node store service
    etcd_conf: dict[str, str] = field(default_factory=dict)  # TLS/auth keys of --rdzv-conf, for workers
    store: Any = None                   # resilient.agent.store.StoreSettings; None = no memory tiers
    # What the workers run: ``worker_entry.main(worker_argv)`` in a process that imported
    # ``worker_preload`` first (see resilient.agent.warm). The launcher names the program (the
    # built-in GPT's worker, or resilient.agent.script for a user's script): never the agent.
    worker_entry: str = SCRIPT_ENTRY
    worker_argv: list[str] = field(default_factory=list)
    worker_preload: tuple[str, ...] = ()
    worker_env: dict[str, str] = field(default_factory=dict)
    # Whether the program beats from its first step (the built-in GPT). A user's script beats
    # only once it calls resilient.job's step boundary, so until a worker's first beat the agent
    # neither kills it as hung at startup_timeout nor counts its exit as a startup failure.
    worker_heartbeats: bool = True
    runtime_config: str = ""            # RuntimeConfig JSON for the workers (contract.RUNTIME_CONFIG_ENV)
    failslow: FailSlowConfig = field(default_factory=FailSlowConfig)  # [failslow]: the seat hand-over's policy
    metrics_port: int | None = None     # Prometheus /metrics (resilient.agent.metrics): 0 = a free port, None = off
    metrics_host: str = "127.0.0.1"     # ... the address it binds (launch.metrics_host)
    durable_url: str = ""               # snapshot.durable_url: where the ledger's durable copy goes ("" = RUN_DIR/checkpoints)


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:3"`` → (1, 3)."""
    try:
        lo, _, hi = str(value).partition(":")
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise AgentError(f"--nnodes {value!r}: expected N or MIN:MAX, e.g. --nnodes 1:3") from None
    if not 1 <= lo_n <= hi_n:
        raise AgentError(f"--nnodes {value!r}: need 1 ≤ MIN ≤ MAX")
    return lo_n, hi_n
