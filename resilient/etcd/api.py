"""Typed errors and value types of resilient's etcd v3 layer.

Everything that talks to etcd (the rendezvous backend, the agent's liveness
lease, the commit records of the snapshot tiers) goes through
:class:`resilient.etcd.client.EtcdClient`, and everything that can go wrong
there surfaces as one of the errors below, each saying what to do. Callers
catch :class:`EtcdUnavailable` to tell "etcd is down or unreachable" (retry
later, check the cluster) from :class:`EtcdError` in general (a request etcd
refused: wrong credentials, bad TLS files, a malformed key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from resilient.errors import ResilientError

__all__ = [
    "EtcdError",
    "EtcdNotFound",
    "EtcdUnavailable",
    "EtcdAuthError",
    "EtcdLeaseExpired",
    "KeyValue",
    "INSTALL_HINT",
]

INSTALL_HINT = (
    "install one with `apt-get install etcd-server` (Debian/Ubuntu) or download a "
    "release from https://github.com/etcd-io/etcd/releases and put `etcd` on PATH"
)


class EtcdError(ResilientError):
    """A request to etcd failed, or an embedded etcd server misbehaved.

    The message names the endpoint(s) and the operation. Subclasses narrow
    the cause; catch this one for "anything etcd".
    """


class EtcdNotFound(EtcdError, FileNotFoundError):
    """No ``etcd`` server binary could be found to start an embedded server."""

    def __init__(self, searched: str) -> None:
        super().__init__(
            f"no etcd server binary found (looked for {searched}); {INSTALL_HINT}. "
            "Or point the run at an existing cluster with --rdzv-endpoint HOST:PORT."
        )


class EtcdUnavailable(EtcdError, ConnectionError):
    """etcd could not be reached within the allowed time.

    Raised after the client's retries (bounded by its ``retry_timeout``) are
    used up, so a caller that sees it knows etcd has been gone for that long.
    """

    def __init__(self, endpoints: Sequence[str], waited_s: float, cause: object) -> None:
        eps = ",".join(endpoints)
        super().__init__(
            f"cannot reach etcd at {eps} (tried for {waited_s:.1f} s; last error: {cause}). "
            f"Check that the cluster is up and reachable from this host: "
            f"`etcdctl --endpoints={eps} endpoint health` (add --cacert/--cert/--key "
            "for TLS), and that the endpoint list, protocol (http/https) and firewall are right."
        )
        self.endpoints = tuple(endpoints)


class EtcdAuthError(EtcdError, PermissionError):
    """etcd refused the credentials or the TLS client certificate."""


class EtcdFull(EtcdError, OSError):
    """etcd's database reached its space quota (the NOSPACE alarm): it refuses every
    write until an operator frees space. Nothing retries this: it does not pass."""

    def __init__(self, what: str, url: str) -> None:
        super().__init__(
            f"etcd {what} at {url}: etcd's database is full (over its --quota-backend-bytes, "
            "2 GiB by default; the NOSPACE alarm is raised) and it refuses every write. Free it: "
            "`etcdctl compact REV` with REV the revision `etcdctl endpoint status -w json` shows, then "
            "`etcdctl defrag` and `etcdctl alarm disarm`. resilient agents compact etcd's history every "
            "launch.etcd_compact_interval: seeing this means that was 0, they could not (their log says "
            "why), or the quota is too small for this job (raise it with --quota-backend-bytes)."
        )


class EtcdLeaseExpired(EtcdError):
    """A lease this process held has expired; keys attached to it are gone.

    Happens when the keep-alive thread could not reach etcd for longer than
    the lease's TTL. Whoever owns the lease must re-register what it held.
    """


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it.

    ``mod_revision`` is the cluster revision of the key's last write: the
    token for compare-and-swap. ``lease`` is 0 when no lease is attached.
    """

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int = 0
