"""Typed errors and records of the run dir's control plane (the embedded etcd of ``resilient launch``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from resilient.errors import LaunchError

__all__ = ["ClaimError", "ClaimForged", "ClaimTimeout", "ClaimElsewhere", "OwnerRecord", "ClaimSettings"]


class ClaimError(LaunchError):
    """The run dir's control plane could not be claimed or joined; the message says why and what to do."""


class ClaimForged(ClaimError):
    """The run dir's owner record does not carry a valid MAC under this node's job secret: written
    by an agent with another secret (nodes of one run dir must share theirs), or by someone else."""


class ClaimTimeout(ClaimError):
    """The owner of the run dir's control plane did not publish a live endpoint within the bound."""


class ClaimElsewhere(ClaimError):
    """The run dir's embedded etcd is owned by an agent on another host: it serves one machine only."""


@dataclass(frozen=True)
class OwnerRecord:
    """Who owns a run dir's embedded etcd, and where it serves: what the other agents and the
    tools (``resilient status``, ``resilient quarantine``) of the run dir read."""

    endpoint: str       # HOST:PORT of the etcd's client URL
    pid: int            # the owning agent
    pid_ticks: int | None   # when it started (resilient.procs.start_ticks): a pid alone may be reused
    host: str           # socket.gethostname() of the owner

    def doc(self) -> dict:
        return {"endpoint": self.endpoint, "pid": self.pid, "pid_ticks": self.pid_ticks, "host": self.host}

    @classmethod
    def of(cls, doc: dict) -> "OwnerRecord":
        ticks = doc.get("pid_ticks")
        return cls(str(doc["endpoint"]), int(doc["pid"]), None if ticks is None else int(ticks), str(doc["host"]))


@dataclass(frozen=True)
class ClaimSettings:
    """How an agent that is not the owner waits for the owner's record.

    ``wait`` bounds the wait for an owner that holds the claim but has not published yet (its
    etcd starting, on a loaded host: etcd's own start bound is 15 s, and a failed start is
    retried); ``progress_every``: how often the wait says so; ``poll``: how often it looks."""

    wait: timedelta = timedelta(seconds=120)
    progress_every: timedelta = timedelta(seconds=10)
    poll: timedelta = timedelta(seconds=0.1)
