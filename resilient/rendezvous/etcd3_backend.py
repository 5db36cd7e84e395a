"""etcd v3 backend and store for torch's ``DynamicRendezvousHandler``.

torch ships only an etcd **v2** backend, and etcd 3.6 removed the v2 API.
This module gives ``DynamicRendezvousHandler`` what it needs on etcd v3:

* :class:`Etcd3RendezvousBackend` holds the rendezvous state under one key.
  ``set_state`` is a compare-and-swap on the key's ``mod_revision`` (the
  fencing token), done in one etcd transaction that also reads the current
  value back, so concurrent agents can never both win a round: each write
  either extends exactly the state it read or fails and returns the winner's.
* :class:`Etcd3Store` is the ``torch.distributed.Store`` the agents use to
  exchange the master address and to run their barriers.

Trust: torch pickles its state into ``set_state`` and unpickles what
``get_state`` returns, so a writer of the key would run code in every agent.
The backend seals each state it writes (a version tag and an HMAC-SHA256 over
the key and the blob, under the job secret: :mod:`resilient.secret`) and
opens each one it reads; a state that fails (tampered, truncated, empty,
written without the secret or with another job's) is
:class:`~.api.RendezvousStateCorrupt` (torch's ``RendezvousStateError``) and
never reaches torch. A node holding another secret than the job's fails the
same way at its first read, with both fingerprints to compare.

Liveness: every key is written with this process's :class:`LivenessLease`
(kept alive by a thread). Agents rewrite the state at every heartbeat, so
while any agent of the run lives the state key stays; once all are gone it
disappears ``lease_ttl`` later, and a new job with the same run id starts
clean instead of inheriting a dead job's membership.
"""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from resilient.etcd.api import EtcdError, EtcdLeaseExpired, EtcdUnavailable
from resilient.etcd.client import EtcdClient, LivenessLease
from resilient.etcd.watch import Watch
from resilient.rendezvous.api import (
    RendezvousError,
    RendezvousRoundLost,
    RendezvousStateCorrupt,
    RendezvousUnavailable,
)
from resilient.secret import RDZV_STATE, JobSecret, Unauthentic, report_unauthentic, require_secret

__all__ = ["Etcd3RendezvousBackend", "Etcd3Store", "DEFAULT_KEY_PREFIX"]

DEFAULT_KEY_PREFIX = "/resilient/rdzv"
_T = TypeVar("_T")
_sleep = time.sleep  # the backoff's wait (a name of its own: tests watch it without touching time.sleep)


def _translate(what: str, fn: Callable[[], _T], lease: LivenessLease | None = None) -> _T:
    """Run ``fn``; map etcd errors to rendezvous errors torch understands.

    A lapsed lease (etcd was unreachable for longer than its TTL) is healed
    by re-granting once and retrying.
    """
    for attempt in range(2):
        try:
            return fn()
        except EtcdLeaseExpired as exc:
            if lease is None or attempt:
                raise RendezvousError(f"{what}: {exc}") from exc
            lease.invalidate()
        except EtcdUnavailable as exc:
            raise RendezvousUnavailable(f"{what}: {exc}") from exc
        except EtcdError as exc:
            raise RendezvousError(f"{what}: {exc}") from exc
    raise AssertionError("unreachable")


class Etcd3RendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd v3, written by compare-and-swap on ``mod_revision``.

    Args:
        client: the etcd client (shared with :class:`Etcd3Store`).
        run_id: the job's run id; the state lives at ``{key_prefix}/{run_id}/state``.
        key_prefix: namespace for all of resilient's rendezvous keys.
        lease: liveness lease to attach writes to; one is created with
            ``lease_ttl`` if not given.
        secret: the job secret (or its key material) that seals the state;
            default: from the environment (:func:`resilient.secret.require_secret`).
    """

    PURPOSE = RDZV_STATE
    # Jittered backoff after a lost compare-and-swap (see _back_off).
    backoff_base: timedelta = timedelta(milliseconds=10)
    backoff_cap: timedelta = timedelta(seconds=2)
    _losses: int = 0

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        lease: LivenessLease | None = None,
        lease_ttl: timedelta = timedelta(seconds=60),
        secret: JobSecret | bytes | None = None,
    ) -> None:
        if not run_id:
            raise RendezvousError("the run id must be a non-empty string (torchrun --rdzv-id)")
        self.secret = (JobSecret.of(secret) if secret is not None
                       else require_secret(what=f"the etcd3 rendezvous of run {run_id!r}"))
        self.client = client
        self.run_id = run_id
        self.key = f"{key_prefix.rstrip('/')}/{run_id}/state"
        self.lease = lease if lease is not None else LivenessLease(client, lease_ttl)

    @property
    def name(self) -> str:
        return "etcd3"

    def get_state(self) -> tuple[bytes, Token] | None:
        kv = _translate(f"reading rendezvous state {self.key}", lambda: self.client.get(self.key))
        return None if kv is None else (self._open(kv.value), kv.mod_revision)

    def _open(self, blob: bytes) -> bytes:
        """torch's state out of a sealed blob; :class:`RendezvousStateCorrupt` if it does not authenticate."""
        try:
            return self.secret.unseal(self.PURPOSE, self.key, blob)
        except Unauthentic as e:
            report_unauthentic(None, "rendezvous state", self.key, e)
            raise RendezvousStateCorrupt(
                f"the rendezvous state fails authentication ({e}); it was not unpickled. Either this node holds "
                f"another job secret than the node that wrote it (compare fingerprints: this node's is "
                f"{self.secret.fingerprint}, from {self.secret.source}), or a process without the secret wrote "
                f"the key. Give every node the same secret; to start the job over, use a new run id or delete "
                f"{self.key}") from None

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        try:
            revision = int(token) if token is not None else None
        except (TypeError, ValueError):
            # Not a token we issued: nothing to compare against; report the current state.
            current = self.get_state()
            return None if current is None else (*current, False)

        sealed = self.secret.seal(self.PURPOSE, self.key, state)

        def cas() -> tuple[bytes, Token, bool] | None:
            res = self.client.compare_and_swap(
                self.key, sealed, mod_revision=revision, lease=self.lease.id
            )
            if res.kv is None:
                return None
            return res.kv.value, res.kv.mod_revision, res.succeeded

        got = _translate(f"writing rendezvous state {self.key}", cas, self.lease)
        if got is None:
            return None
        value, token_now, won = got
        if won:
            self._losses = 0
            return state, token_now, True
        self._back_off()
        # The winner's state this txn carried is stale after the wait: read the current one
        # (a lost race answers with the newest state, as torch expects).
        current = self.get_state()
        return None if current is None else (*current, False)

    def _back_off(self) -> None:
        """Wait a jittered, growing while after a lost compare-and-swap, before torch's handler
        retries.

        Why: torch's handler retries a lost write at once. With N nodes joining together
        every retry races the N-1 others and one wins, so the losers' txns, each carrying
        the whole O(N) state back, swamp etcd: measured with 128 simulated nodes
        (bench/scale.py), ~575 txns/s of which 10/s won, and no round within minutes.
        Full jitter over a window that doubles per consecutive loss (capped) spreads the
        retries out so that the winners' rate is what etcd can fsync; the state is read
        afresh after the wait, so the retry is against the newest revision."""
        self._losses = min(self._losses + 1, 16)
        window = min(self.backoff_cap.total_seconds(),
                     self.backoff_base.total_seconds() * (2 ** (self._losses - 1)))
        _sleep(random.uniform(0.0, window))


class Etcd3Store(dist.Store):
    """A ``torch.distributed.Store`` on etcd v3, for the agents of one run.

    Used by torch's elastic agent for small, infrequent exchanges (master
    address and port, rank assignment, exit barriers), never by training
    traffic. Blocking calls watch the missing keys after their first read and
    read again when one is written (:mod:`resilient.etcd.watch`); where no watch
    can be had they poll (a backoff capped at 50 ms, at ``slow_poll`` once a wait
    lasts past a second). All awaited keys are read in one request per 128.

    ``guard``, when set (the etcd3 handler sets it to its ``round_lost``), is
    asked every ``guard_interval`` while a wait is unmet: keys a dead member
    was to write never come, so a reason from it ends the wait at once with
    :class:`RendezvousRoundLost` instead of after the whole store timeout.
    """

    guard: Callable[[], str | None] | None = None
    guard_interval: timedelta = timedelta(seconds=0.5)
    # A wait watches its missing keys (resilient.etcd.watch) and reads when one is written,
    # else every ``watched_poll``; ``slow_poll``: how often a wait past its first second
    # reads where no watch can be had.
    watched_poll: timedelta = timedelta(seconds=5)
    slow_poll: timedelta = timedelta(seconds=0.5)

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        lease: LivenessLease | None = None,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        super().__init__()
        self.client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.lease = lease
        self.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _lease_id(self) -> int | None:
        return self.lease.id if self.lease is not None else None

    @staticmethod
    def _bytes(value: bytes | str) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode()

    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        _translate(f"store set {key}", lambda: self.client.put(
            self._k(key), self._bytes(value), lease=self._lease_id()), self.lease)

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """Blocks until ``key`` exists (up to the store timeout), like every c10d store."""
        return self._wait([key], self.timeout)[0]

    def add(self, key: str, num: int) -> int:  # type: ignore[override]
        def loop() -> int:
            k = self._k(key)
            kv = self.client.get(k)
            while True:
                new = (int(kv.value) if kv is not None else 0) + int(num)
                res = self.client.compare_and_swap(
                    k, str(new), mod_revision=kv.mod_revision if kv else None,
                    lease=self._lease_id())
                if res.succeeded:
                    return new
                kv = res.kv

        return _translate(f"store add {key}", loop, self.lease)

    def compare_set(self, key: str, expected_value: bytes | str,  # type: ignore[override]
                    desired_value: bytes | str) -> bytes:
        """c10d semantics: set if current == expected (or absent and expected is empty)."""
        expected, desired = self._bytes(expected_value), self._bytes(desired_value)

        def cas() -> bytes:
            k = self._k(key)
            if expected:
                res = self.client.compare_value_and_swap(k, expected, desired, lease=self._lease_id())
                if res.kv is None:  # absent and a non-empty expectation: c10d returns expected
                    return expected
            else:
                res = self.client.compare_and_swap(k, desired, mod_revision=None, lease=self._lease_id())
            assert res.kv is not None
            return res.kv.value

        return _translate(f"store compare_set {key}", cas, self.lease)

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        """Blocks until every key exists; their values, read together (one request per poll,
        not one per key: N agents reading each other's keys cost N, not N², requests)."""
        return self._wait(keys, self.timeout)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        kvs = _translate("store check", lambda: self.client.get_many([self._k(k) for k in keys]))
        return all(kv is not None for kv in kvs)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self._wait(keys, self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return _translate(f"store delete {key}", lambda: self.client.delete(self._k(key)))

    def num_keys(self) -> int:  # type: ignore[override]
        return _translate("store num_keys", lambda: self.client.count_prefix(self.prefix))

    def _wait(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 0.005
        next_guard = time.monotonic() + self.guard_interval.total_seconds()
        watch: Watch | None = None
        read, missing, revision, last_read = True, list(keys), None, 0.0
        got: dict[str, bytes] = {}   # keys read so far: only the missing ones are read again
        try:
            while True:
                if read:
                    last_read = time.monotonic()
                    asked = list(dict.fromkeys(k for k in keys if k not in got))
                    kvs, revision = _translate("store wait", lambda: self.client.get_many_at([self._k(k) for k in asked]))
                    got.update({k: kv.value for k, kv in zip(asked, kvs) if kv is not None})
                    missing = [k for k in dict.fromkeys(keys) if k not in got]
                    if not missing:
                        return [got[k] for k in keys]
                now = time.monotonic()
                if self.guard is not None and now >= next_guard:
                    next_guard = now + self.guard_interval.total_seconds()
                    reason = self.guard()
                    if reason:
                        raise RendezvousRoundLost(
                            f"etcd store {self.prefix}: stopped waiting for keys {missing}: {reason}; "
                            f"joining the next round")
                if now >= deadline:
                    raise dist.DistStoreError(
                        f"etcd store {self.prefix}: keys {missing} were not set within "
                        f"{timeout.total_seconds():.1f} s; a peer agent is missing or slow"
                    )
                waited = timeout.total_seconds() - (deadline - now)
                if watch is None:
                    # A wait that lasts is for a slow peer (or for one node gathering N): from
                    # now on read when a missing key is written, not at a rate. N agents polling
                    # swamped etcd at hundreds of nodes (bench/scale.py, 512 nodes: 10k reads
                    # a second at 50 ms). From the read's revision: nothing is missed (without
                    # one, read once more after opening it).
                    gone = [self._k(k) for k in missing]
                    common = gone[0] if len(gone) == 1 else os.path.commonprefix(gone)
                    watch = Watch(self.client, common, prefix=len(gone) > 1, after=revision,
                                  fallback=self.slow_poll, open_timeout=timedelta(seconds=deadline - now))
                    if revision is None:
                        continue
                if watch is not None and not watch.broken:
                    until = min(deadline, next_guard) if self.guard is not None else deadline
                    until = min(until, last_read + self.watched_poll.total_seconds())
                    # a quiet watch needs no read, only the guard's (a dead peer writes nothing);
                    # but every watched_poll one all the same (a watch that went quiet on a
                    # member cut off from its cluster would otherwise hold the wait to its end)
                    changed = watch.wait(max(0.0, until - now))
                    now = time.monotonic()
                    read = changed or now >= deadline or now >= last_read + self.watched_poll.total_seconds()
                    continue
                # No watch to be had: poll, fast at first (a barrier's keys come within ms),
                # then every slow_poll (N agents polling at 20/s swamp etcd at hundreds of nodes)
                read = True
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 0.05 if waited < 1.0 else self.slow_poll.total_seconds())
        finally:
            if watch is not None:
                watch.close()
