"""Leases: an etcd lease this process granted, and one that lasts as long as the process.

The gateway has no streaming keep-alive, hence :class:`Lease`'s refresh thread. A key
attached to a :class:`LivenessLease` says "this process is here": it vanishes ``ttl``
after the process dies.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

from resilient.etcd.api import EtcdError, EtcdLeaseExpired

if TYPE_CHECKING:
    from resilient.etcd.client import EtcdClient

__all__ = ["Lease", "LivenessLease"]

log = logging.getLogger(__name__)


class Lease:
    """An etcd lease this process granted, optionally kept alive by a thread."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: timedelta,
                 on_expired: Callable[[Lease], None] | None = None) -> None:
        self.client = client
        self.id = lease_id
        self.ttl = ttl
        self._on_expired = on_expired
        self._expired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def expired(self) -> bool:
        """True once etcd has told us the lease is gone."""
        return self._expired

    def refresh(self, retry_timeout: timedelta | None = None) -> timedelta:
        """Reset the TTL now; raises :class:`EtcdLeaseExpired` if it already lapsed."""
        resp = self.client._post("/lease/keepalive", {"ID": self.id},
                                 f"lease keep-alive {self.id:x}", retry_timeout)
        ttl = int((resp.get("result") or {}).get("TTL", 0))  # absent (0): lease is gone
        if ttl <= 0:
            self._mark_expired()
            raise EtcdLeaseExpired(f"etcd lease {self.id:x} has expired; keys attached to it are gone")
        return timedelta(seconds=ttl)

    def remaining(self) -> timedelta | None:
        """Time left before expiry, or ``None`` if the lease is gone."""
        resp = self.client._post("/kv/lease/timetolive", {"ID": self.id}, "lease ttl")
        ttl = int(resp.get("TTL", 0))  # proto3 JSON omits 0; a lapsed lease says -1
        return None if ttl < 0 else timedelta(seconds=ttl)

    def revoke(self) -> None:
        """Revoke now: etcd deletes every key attached to it at once."""
        self.stop_keep_alive()
        try:
            self.client._post("/kv/lease/revoke", {"ID": self.id}, "lease revoke")
        except EtcdLeaseExpired:
            pass
        self._expired = True

    def _mark_expired(self) -> None:
        if not self._expired:
            self._expired = True
            self._stop.set()
            log.warning("etcd lease %x expired", self.id)
            if self._on_expired is not None:
                self._on_expired(self)

    def start_keep_alive(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._keep_alive_loop, name=f"etcd-lease-{self.id:x}", daemon=True
            )
            self._thread.start()

    def stop_keep_alive(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.client.request_timeout.total_seconds() + 1)

    def _keep_alive_loop(self) -> None:
        interval = max(self.ttl.total_seconds() / 3, 0.05)
        while not self._stop.wait(interval):
            try:
                # Bounded by one interval so a long outage cannot starve refreshes.
                self.refresh(retry_timeout=timedelta(seconds=interval))
            except EtcdLeaseExpired:
                return
            except EtcdError as exc:  # unreachable for now; etcd restores leases on restart
                log.debug("etcd lease %x keep-alive failed: %s", self.id, exc)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revoke()


class LivenessLease:
    """A lease that lasts as long as this process: kept alive, re-granted if it lapsed.

    Use it to attach "this node is here" keys: they vanish ``ttl`` after the
    process dies. If etcd was unreachable for longer than ``ttl`` the old lease
    is gone; :attr:`id` then grants a fresh one, so writers that attach keys
    via ``lease=liveness.id`` heal by themselves.
    """

    def __init__(self, client: EtcdClient, ttl: timedelta) -> None:
        self.client = client
        self.ttl = ttl
        self._lock = threading.Lock()
        self._lease: Lease | None = None

    @property
    def id(self) -> int:
        with self._lock:
            if self._lease is None or self._lease.expired:
                self._lease = self.client.lease(self.ttl)
            return self._lease.id

    def invalidate(self, lease_id: int | None = None) -> None:
        """Forget the lease (etcd said it is gone) so the next :attr:`id` re-grants.

        With ``lease_id``, only if that is still the current lease (so two
        threads noticing the same lapse re-grant once).
        """
        with self._lock:
            if self._lease is not None and lease_id in (None, self._lease.id):
                self._lease.stop_keep_alive()
                self._lease = None

    def close(self, revoke: bool = False) -> None:
        with self._lock:
            if self._lease is not None:
                if revoke:
                    self._lease.revoke()
                else:
                    self._lease.stop_keep_alive()
                self._lease = None
