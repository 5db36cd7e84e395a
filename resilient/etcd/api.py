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
    "EtcdAuthDisabled",
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


class EtcdAuthDisabled(EtcdAuthError):
    """An etcd this client logs in to answered that its authentication is not enabled.

    Not an outage and not a wrong password: an etcd that had authentication on (the embedded
    etcd of ``resilient launch`` turns it on before anyone is told its endpoint) does not turn
    it off by itself. Someone did (an attacker through etcd 3.4/3.5's NOSPACE-alarm gap, or an
    operator by hand), or the endpoint is another etcd than the job's: whatever is in it may
    have been written by anyone, so the job stops rather than go on with it."""

    def __init__(self, url: str, user: str | None) -> None:
        super().__init__(
            f"etcd at {url} says its authentication is not enabled, but this client logs in (as "
            f"{user!r}): someone turned it off (an attack, e.g. through the NOSPACE-alarm gap of etcd "
            "3.4/3.5, or an operator), or this endpoint is not the job's etcd. Do not trust what is in it: "
            "stop the job, check who can reach this etcd (`etcdctl auth status`), and relaunch (an embedded "
            "etcd of `resilient launch` requires the job's client certificate, which closes that gap)")
        self.url, self.user = url, user


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
