"""Types shared by the agent's parts: settings, failures and typed errors."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from resilient.errors import ResilientError


# The environment a worker gets beyond torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...):
# what resilient.job reads to find the run it belongs to.
RUN_DIR_ENV = "RESILIENT_RUN_DIR"       # the run dir, absolute: events.jsonl, checkpoints
NODE_ID_ENV = "RESILIENT_NODE_ID"       # this node's id (--node-id, default the hostname)


class AgentError(ResilientError):
    """The agent cannot run the job (bad --nnodes, no rendezvous, ...)."""


# A worker's exit code for "training finished, but its final state could not be made
# durable" (a full disk, a read-only URL): a restart would only repeat it, so the agent
# stops and the launcher fails the run with the worker's error.
NOT_DURABLE_EXIT = 76

# A worker's exit code for "another node was told to stop (a preemption), and every rank
# stopped after the same step and saved it": this node is not going away, so its agent
# re-forms the job without the leaver and goes on, as on a lost node (no restart counted).
PEER_LEFT_EXIT = 77


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
    worker_entry: str = "resilient.agent.script"
    worker_argv: list[str] = field(default_factory=list)
    worker_preload: tuple[str, ...] = ()
    worker_env: dict[str, str] = field(default_factory=dict)
    # Whether the program beats from its first step (the built-in GPT). A user's script beats
    # only once it calls resilient.job's step boundary, so until a worker's first beat the agent
    # neither kills it as hung at startup_timeout nor counts its exit as a startup failure.
    worker_heartbeats: bool = True
    runtime_config: str = ""            # RuntimeConfig JSON for the workers (RESILIENT_RUNTIME_CONFIG)
    metrics_port: int | None = None     # Prometheus /metrics (resilient.observe.metrics): 0 = a free port, None = off
    metrics_host: str = "127.0.0.1"     # ... the address it binds (launch.metrics_host)
    durable_url: str = ""               # snapshot.durable_url: where the ledger's durable copy goes ("" = RUN_DIR/checkpoints)


# The step of this worker process's clean ``run_end`` (its state saved), once it has one.
_clean_run_end: list[int] = []
# What a collective's failure says when a peer's process is gone (gloo, NCCL, the TCP store).
_PEER_GONE = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe")


def mark_clean_run_end(step: int) -> None:
    """This worker ended its run cleanly at ``step``: its last state is saved (``Job.finish``)."""
    _clean_run_end[:] = [step]


def peer_gone_after_run_end(error: BaseException) -> int | None:
    """The step of this worker's clean ``run_end`` when ``error`` is a collective's failure raised
    after it, else None. A peer that already ended its run (or whose node stopped) breaks the
    process group for whatever the script does after the loop; this worker's state was saved,
    so that is no worker error (issue 38: a gloo traceback logged after a clean ``run_end``).
    Any other error after the end is still one: a user's own bug is never hidden."""
    if not _clean_run_end:
        return None
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:   # the error or what it was raised from
        seen.add(id(e))
        # torch.distributed's DistError family by name: this module must not import torch
        if any(c.__name__ == "DistError" for c in type(e).__mro__) or (
                isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _PEER_GONE)):
            return _clean_run_end[0]
        e = e.__cause__ or e.__context__
    return None


def said_peer_gone(error: BaseException) -> bool:
    """After this worker's clean ``run_end``, a collective that failed because a peer already
    left is said in one line (no traceback, no ``worker_error``), and the worker may exit 0:
    its state was saved, nothing failed. False for any other error."""
    step = peer_gone_after_run_end(error)
    if step is None:
        return False
    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(f"resilient: this worker ended its run at step {step} (saved); after that a collective failed because "
          f"a peer had already left ({type(error).__name__}: {first}): not an error", file=sys.stderr, flush=True)
    return True


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
