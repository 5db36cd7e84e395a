"""A rendezvous whose cost per node does not grow with the fleet: a key per node.

torch's ``DynamicRendezvousHandler`` keeps a round in one blob that every node
changes by compare-and-swap: N nodes joining together pay ~3N writes of an
O(N) blob, one at a time, and every waiting node re-reads the blob at each
poll (bench/scale.py: a re-form after one lost node took 35 s at 128 nodes,
303 s at 256). :class:`KeyedRendezvousHandler` has the same
``RendezvousHandler`` interface (the agent cannot tell them apart) and a
protocol in which no write contends with another node's:

===============================  ============================================
``{base}/round``                 the current round r (a counter; moved on by
                                 compare-and-swap, so one node bumps it)
``{base}/{r}/join/{node}``       node joined round r (one put; its lease, so
                                 it vanishes when the node dies)
``{base}/{r}/done``              round r's members in rank order: written
                                 once, create-only, by the oldest joiner
                                 (by another member if it died)
``{base}/{r}/wait/{node}``       node waits for a round after r (r is done
                                 and has room: the members re-form for it)
``{base}/{r}/spare/{node}``      node waits for a seat (r is done and full:
                                 nobody re-forms for it)
``{base}/closed``                the job ended
===============================  ============================================

A round's life (per r): **open** (joins accepted; it is closed once
``max_nodes`` joined, or ``min_nodes`` did and no join came for ``last_call``:
:class:`_LastCall`) → **done**
(the ``done`` record exists: later arrivals wait or stand by) →
**abandoned** (``round`` moved past r: a member came back to re-form, i.e. its
agent restarts, or it was lost). Exactly one membership per round: ``done``
is created by a transaction that fails if it exists. A node polls with one
transaction of small reads (the round, ``done``, the join count, ``closed``,
its own join key; while it joins, the oldest joiner) and reads the O(N)
``done`` record once; per round etcd sees N small puts, one
membership write and one counter bump.

Every record is sealed with the job secret (:mod:`resilient.secret`) and
opened before use; nothing here is unpickled. Liveness is an etcd lease of
torch's keep-alive window (kept alive by a thread: no keep-alive writes),
and a lost node is evicted by deleting its join key (:meth:`evict`), which
every member's :meth:`round_lost` sees.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from resilient.etcd.client import EtcdClient, LivenessLease, _b64, _range, _response
from resilient.etcd.watch import Watch
from resilient.rendezvous.etcd3_backend import Etcd3Store, _translate
from resilient.secret import RDZV_STATE, JobSecret, Unauthentic, read_records, report_unauthentic

log = logging.getLogger(__name__)

__all__ = ["KeyedRendezvousHandler", "KeyedSettings"]

_local_ids = itertools.count()  # several handlers in one process (tests, bench/scale.py) are distinct nodes


@dataclass
class KeyedSettings:
    """Timeouts of one :class:`KeyedRendezvousHandler` (torch's names)."""

    min_nodes: int
    max_nodes: int
    join_timeout: timedelta = timedelta(seconds=600)
    last_call: timedelta = timedelta(seconds=1)
    # How often a joining or waiting node polls; it grows by ``poll_per_node`` per node seen
    # so that the fleet's polling load on etcd stays near ``1 / poll_per_node`` requests a second.
    poll: timedelta = timedelta(seconds=0.1)
    poll_per_node: timedelta = timedelta(milliseconds=1)
    # A node that waits for something another writes (round r's membership, the next round)
    # watches that key (resilient.etcd.watch) and polls this many times less often: etcd says
    # when to read. Only the round's closer, which counts the arrivals, polls at the full rate.
    watched_slowdown: int = 5
    # How long the running members' periodic check (:meth:`num_nodes_waiting`) retries an etcd
    # that does not answer before it says so. Why not the client's 30 s: the check comes again
    # a moment later anyway, and an agent blocked inside it learns nothing else meanwhile
    # (measured: the embedded etcd's owner killed, the other agent sat 30 s in this read
    # before it saw the control plane was gone). Long enough for a member of a three-member
    # cluster to fail over (1-2 s of election, a login).
    waiting_check_retry: timedelta = timedelta(seconds=5)


class KeyedRendezvousHandler(RendezvousHandler):
    """See the module docstring. ``store`` is the run's :class:`~.etcd3_backend.Etcd3Store`
    (each round's store is a prefix of it, as torch's handler does)."""

    def __init__(self, run_id: str, client: EtcdClient, store: Store, lease: LivenessLease,
                 secret: JobSecret, settings: KeyedSettings, *, key_prefix: str,
                 local_addr: str | None = None) -> None:
        if not 1 <= settings.min_nodes <= settings.max_nodes:
            raise ValueError(f"nnodes {settings.min_nodes}:{settings.max_nodes}: need 1 <= min <= max")
        self.run_id, self.client, self.lease, self.secret, self.settings = run_id, client, lease, secret, settings
        self._store = store
        self.base = f"{key_prefix.rstrip('/')}/{run_id}/k"
        self.addr = local_addr or socket.getfqdn()
        self._node = f"{self.addr}_{os.getpid()}_{next(_local_ids)}"
        # (round, members in rank order) of the round this node last joined; None before.
        self._joined: tuple[int, list[str]] | None = None
        self._spare = False
        self._put_join: str | None = None  # the join key this node last wrote
        self._waiting: tuple[int, float, int] | None = None  # num_nodes_waiting's last read: round, until, answer

    neighbours = 3  # members each member probes in evict()

    # -- the RendezvousHandler interface -------------------------------------------
    def get_backend(self) -> str:
        return "etcd3"

    @property
    def node_desc(self) -> str:
        """This node's name in the join records (``addr_pid_localid``, like torch's)."""
        return self._node

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self._get(f"{self.base}/closed") is not None

    def set_closed(self) -> None:
        key = f"{self.base}/closed"
        value = self.secret.seal_record(RDZV_STATE, key, {"by": self._node})
        # On the closer's lease: it lapses once the job's agents are gone, so the run id can be used again.
        _translate("closing the rendezvous", lambda: self.client.put(key, value, lease=self.lease.id), self.lease)

    def shutdown(self) -> bool:
        try:
            self.set_closed()
            return True
        except Exception as e:
            log.warning("could not close the rendezvous %s: %s", self.run_id, e)
            return False

    def num_nodes_waiting(self) -> int:
        """Nodes a re-form would admit: waiters while this node's round has room, and 1 when
        the round was abandoned (another member came back to re-form: so must this one).

        Read from etcd at most once per poll interval (which grows with the round's size, as
        a joining node's does), the answer kept in between. Why: torch's agent asks at every
        healthy check (``monitor_interval``, 0.1 s), on every node, all run long: 5,120 etcd
        transactions a second at 512 nodes, where the interval keeps the fleet near
        ``1 / poll_per_node`` (bench/scale.py's idle phase asks as the agent does)."""
        if self._joined is None:
            return 0
        r, members = self._joined
        now = time.monotonic()
        if self._waiting is not None and self._waiting[0] == r and now < self._waiting[1]:
            return self._waiting[2]
        got = self._poll(r, count=f"{self.base}/{r}/wait/", retry=self.settings.waiting_check_retry)
        if got.round != r:
            waiting = 1
        else:
            waiting = got.count if len(members) < self.settings.max_nodes else 0
        self._waiting = (r, now + self._interval(len(members)), waiting)
        return waiting

    def next_rendezvous(self) -> RendezvousInfo:
        deadline = time.monotonic() + self.settings.join_timeout.total_seconds()
        came_back, self._joined, self._put_join = self._joined, None, None
        self._waiting = None  # keyed by round number, which etcd losing its counter may repeat
        # Our agent restarts its workers: every member re-forms (the round moves on, unless
        # another member moved it already; one transaction either way, not a read first:
        # 512 members coming back at once are 512 of them).
        r = self._abandon(came_back[0]) if came_back is not None else self._round()
        call = _LastCall(self.settings)
        with _Waits(self) as waits:
            return self._next_round(r, call, deadline, waits)

    def _next_round(self, r: int, call: "_LastCall", deadline: float, waits: "_Waits") -> RendezvousInfo:
        """:meth:`next_rendezvous` from round r on (``waits``: the watch it sleeps on)."""
        while True:
            got = self._poll(r, count=f"{self.base}/{r}/join/", joining=True)
            if got.closed:
                if self._spare:
                    raise RendezvousGracefulExitError(f"the rendezvous {self.run_id!r} is closed: a spare leaves")
                raise RendezvousClosedError()
            if got.round != r:  # moved on while we looked: join the current one
                r, call = got.round, _LastCall(self.settings)
                continue
            if got.done is not None:
                members = self._open_done(r, got.done)
                if self._node in members:
                    return self._joined_round(r, members)
                self._stand_by(r, members)  # a late arrival: wait for the round after r
                r, call = self._wait_round_after(r, deadline, waits), _LastCall(self.settings)
                continue
            if not got.mine:  # not yet, or etcd lost it (a restart from an old snapshot)
                self._put_join = None
            self._join(r)
            now = time.monotonic()
            # The oldest joiner closes the round; the others only if it has not a while later
            # (it died): one node, not N, reads the N join records.
            if call.ready(got.count, now, closer=got.oldest == self._put_join) and self._close_round(r):
                continue
            if now > deadline:
                self._delete(f"{self.base}/{r}/join/{self._node}")
                raise RendezvousTimeoutError(
                    f"the rendezvous {self.run_id!r} did not form round {r} within "
                    f"{self.settings.join_timeout.total_seconds():.0f} s: {got.count} of at least "
                    f"{self.settings.min_nodes} node(s) joined")
            if got.oldest == self._put_join or not got.mine:
                # the closer counts the arrivals for its last call; and a read from before this
                # node's join cannot tell whether it is the closer (the first in an empty round)
                self._sleep(got.count)
            else:
                waits.until_changed(f"{self.base}/{r}/done", got.count, got.revision)

    # -- what the agent adds -------------------------------------------------------
    def members_by_rank(self) -> list[str]:
        """The names (as :meth:`evict` gives them) of this node's round's members, by rank."""
        return list(self._joined[1]) if self._joined is not None else []

    def round_lost(self) -> str | None:
        """Why this node's round cannot go on (see ``ResilientRendezvousHandler.round_lost``)."""
        if self._joined is None:
            return None
        r, members = self._joined
        got = self._poll(r, count=f"{self.base}/{r}/join/")
        if got.closed:
            return "the rendezvous was closed"
        if got.round != r:
            return f"round {r} was replaced by round {got.round}"
        if got.count < len(members):
            return f"{len(members) - got.count} member(s) of round {r} left or were evicted"
        return None

    def evict(self, is_dead: Callable[[list[str]], set[str]], attempts: int = 3) -> list[str]:
        """Delete the join keys of this node's ring neighbours in its round (the ``neighbours``
        members after it in rank order) that ``is_dead`` proves gone.

        Only neighbours: every member probing every other is N² probes a re-form (seconds of
        CPU at hundreds of nodes); this way each member is probed by ``neighbours`` others.
        Nor does a re-form wait for it: the first member back moves the round on, and
        the new round has whoever joins it. Eviction only tells members still in the old
        round (waiting in its store) at once."""
        if self._joined is None:
            return []
        r, members = self._joined
        me = members.index(self._node) if self._node in members else -1
        others = [members[(me + i) % len(members)] for i in range(1, min(self.neighbours, len(members) - 1) + 1)]
        dead = sorted(is_dead(others) & set(others)) if others else []
        for d in dead:
            self._delete(f"{self.base}/{r}/join/{d}")
        if dead:
            log.warning("evicted from the rendezvous, proven dead: %s", ", ".join(dead))
        return dead

    def leave(self) -> None:
        """Leave this node's round now (a preempted node): the others' :meth:`round_lost`
        sees it at once instead of at its lease's expiry."""
        self._waiting = None
        if self._joined is not None:
            self._delete(f"{self.base}/{self._joined[0]}/join/{self._node}")

    # -- the protocol ----------------------------------------------------------------
    @dataclass
    class _Seen:
        round: int
        done: bytes | None   # round r's membership record (b"" when only its existence was read)
        count: int
        closed: bool
        mine: bool   # this node's join key of round r exists
        oldest: str | None  # the oldest join key of round r (its closer)
        revision: int = 0   # etcd's revision of this read (a watch reports what changed since)

    def _poll(self, r: int, count: str, joining: bool = False,
              retry: timedelta | None = None) -> "KeyedRendezvousHandler._Seen":
        """The round counter, round r's ``done``, how many keys under ``count``, ``closed``,
        whether this node's join key is there, and (``joining``) round r's oldest joiner: one
        transaction of small reads, retried for ``retry`` (default: the client's) while etcd
        does not answer.

        Only a joining node reads the O(N) ``done`` record and asks for the oldest joiner
        (it may be the round's closer). The members' own checks (:meth:`round_lost`,
        :meth:`num_nodes_waiting`, on every node for the whole run) need neither:
        - ``done`` only needs to exist there: reading it was N² bytes a check across the
          fleet (bench/scale.py at 256 nodes, a 10% re-form and its settling: 17.5 MB of
          etcd traffic before, 3.7 MB after);
        - etcd answers a range sorted by creation by reading every key in it: with 512 join
          keys a poll cost 1.2 ms of etcd CPU with it and 0.7 ms without (1,000 polls each,
          this host)."""
        ops = [{"request_range": {"key": _b64(f"{self.base}/round")}},
               {"request_range": {"key": _b64(f"{self.base}/{r}/done"), **({} if joining else {"count_only": True})}},
               {"request_range": {**_range(count), "count_only": True}},
               {"request_range": {"key": _b64(f"{self.base}/closed")}},
               {"request_range": {"key": _b64(f"{self.base}/{r}/join/{self._node}"), "count_only": True}}]
        if joining:
            ops.append({"request_range": {**_range(f"{self.base}/{r}/join/"), "limit": 1, "keys_only": True,
                                          "sort_target": "CREATE", "sort_order": "ASCEND"}})
        resp = _translate(f"reading rendezvous round {r}", lambda: self.client.txn([], ops, [], retry_timeout=retry))
        reads = [_response(x, "range") for x in resp.get("responses") or []]
        kvs = [(x.get("kvs") or [None])[0] for x in reads]
        round_now = self._round_of(_decode(kvs[0]["value"])) if kvs[0] else 0
        if joining:
            done = _decode(kvs[1]["value"]) if kvs[1] else None
        else:
            done = b"" if int(reads[1].get("count", 0)) > 0 else None
        oldest = _decode(kvs[5]["key"]).decode() if len(kvs) > 5 and kvs[5] else None
        return self._Seen(round_now, done, int(reads[2].get("count", 0)), kvs[3] is not None,
                          int(reads[4].get("count", 0)) > 0, oldest, int((resp.get("header") or {}).get("revision", 0)))

    def _round_of(self, raw: bytes | None) -> int:
        key = f"{self.base}/round"
        try:
            return int(self.secret.open_record(RDZV_STATE, key, raw or b"")["round"])
        except (Unauthentic, KeyError, ValueError, TypeError) as e:
            report_unauthentic(None, "rendezvous round", key, e)
            raise _corrupt(key, e) from None

    def _open_done(self, r: int, raw: bytes) -> list[str]:
        key = f"{self.base}/{r}/done"
        try:
            members = self.secret.open_record(RDZV_STATE, key, raw)["members"]
            if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
                raise ValueError("members is not a list of node names")
            return members
        except (Unauthentic, KeyError, ValueError) as e:
            report_unauthentic(None, "rendezvous membership", key, e)
            raise _corrupt(key, e) from None

    def _round(self) -> int:
        """The current round, creating the counter (round 0) if this is the run's first node."""
        key = f"{self.base}/round"
        value = self.secret.seal_record(RDZV_STATE, key, {"round": 0})
        res = _translate("creating the rendezvous round", lambda: self.client.compare_and_swap(
            key, value, mod_revision=None))
        return 0 if res.succeeded else self._round_of(res.kv.value if res.kv else None)

    def _abandon(self, r: int) -> int:
        """Move the counter from r to r+1 (if nobody did) and drop round r-1's keys; the round now."""
        key = f"{self.base}/round"
        old = self.secret.seal_record(RDZV_STATE, key, {"round": r})
        new = self.secret.seal_record(RDZV_STATE, key, {"round": r + 1})
        res = _translate("moving to the next rendezvous round",
                         lambda: self.client.compare_value_and_swap(key, old, new))
        if res.succeeded and r >= 1:
            _translate("dropping an old round", lambda: self.client.delete_prefix(f"{self.base}/{r - 1}/"))
        if not res.succeeded and res.kv is None:
            return self._round()   # no counter at all (etcd lost it): the run's first round again
        return r + 1 if res.succeeded else self._round_of(res.kv.value if res.kv else None)

    def _join(self, r: int) -> None:
        key = f"{self.base}/{r}/join/{self._node}"
        if self._put_join == key:
            return
        value = self.secret.seal_record(RDZV_STATE, key, {"node": self._node, "addr": self.addr})
        _translate(f"joining round {r}", lambda: self.client.put(key, value, lease=self.lease.id), self.lease)
        self._put_join = key

    def _close_round(self, r: int) -> bool:
        """Write round r's membership from its join records, unless another member did first;
        False when the records do not make a round yet (a view older than the count's)."""
        prefix = f"{self.base}/{r}/join/"
        joined = _translate(f"reading round {r}'s joins", lambda: read_records(
            self.client, prefix, RDZV_STATE, self.secret, None, "rendezvous join"))
        names = sorted((doc.get("node") for k, doc in joined.items() if doc.get("node") == k), key=_node_order)
        members = names[: self.settings.max_nodes]
        if len(members) < self.settings.min_nodes:
            return False
        key = f"{self.base}/{r}/done"
        value = self.secret.seal_record(RDZV_STATE, key, {"members": members})
        _translate(f"closing round {r}", lambda: self.client.compare_and_swap(key, value, mod_revision=None))
        return True

    def _joined_round(self, r: int, members: list[str]) -> RendezvousInfo:
        self._joined, self._spare = (r, members), False
        rank, world = members.index(self._node), len(members)
        # The store's waits ask round_lost (one transaction, counting the round's N join keys)
        # at this interval: every 0.5 s on every node was ~1,000 transactions a second at 512
        # nodes while they exchanged their ids; now as often as a watching node polls.
        if isinstance(self._store, Etcd3Store):
            self._store.guard_interval = timedelta(seconds=max(
                Etcd3Store.guard_interval.total_seconds(), self._interval(world) * self.settings.watched_slowdown))
        store = PrefixStore(f"torch.rendezvous.{self.run_id}.{r}", self._store)
        log.info("node %s joined round %d of the rendezvous %r as rank %d of %d",
                 self._node, r, self.run_id, rank, world)
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo.build(rank, store, local_addr=self.addr))

    def _stand_by(self, r: int, members: list[str]) -> None:
        """Round r is done without us: wait (it has room: the members re-form for us) or stand by."""
        self._delete(f"{self.base}/{r}/join/{self._node}")
        self._spare = len(members) >= self.settings.max_nodes
        key = f"{self.base}/{r}/{'spare' if self._spare else 'wait'}/{self._node}"
        value = self.secret.seal_record(RDZV_STATE, key, {"node": self._node})
        _translate("waiting for a seat", lambda: self.client.put(key, value, lease=self.lease.id), self.lease)

    def _wait_round_after(self, r: int, deadline: float, waits: "_Waits") -> int:
        """Wait until the round moves past r; the round then. A done round none of whose
        members is alive (their join keys lapsed with their leases: a job that ended or
        died under this run id) is abandoned here, as torch's state lapses with its lease."""
        while True:
            got = self._poll(r, count=f"{self.base}/{r}/join/")
            if got.round == r and got.count == 0 and not got.closed:
                got.round = self._abandon(r)
            if got.round != r or got.closed:
                self._delete(f"{self.base}/{r}/{'spare' if self._spare else 'wait'}/{self._node}")
                return got.round
            if not self._spare and time.monotonic() > deadline:
                raise RendezvousTimeoutError(f"node {self._node} waited for a seat in the rendezvous "
                                             f"{self.run_id!r} longer than the join timeout")
            waits.until_changed(f"{self.base}/round", got.count, got.revision)

    # -- small helpers -----------------------------------------------------------------
    def _get(self, key: str):
        return _translate(f"reading {key}", lambda: self.client.get(key))

    def _delete(self, key: str) -> None:
        _translate(f"deleting {key}", lambda: self.client.delete(key))
        if key == self._put_join:
            self._put_join = None

    def _interval(self, nodes_seen: int) -> float:
        s = self.settings
        return s.poll.total_seconds() + nodes_seen * s.poll_per_node.total_seconds()

    def _sleep(self, nodes_seen: int) -> None:
        time.sleep(self._interval(nodes_seen))


class _Waits:
    """The watch a waiting node sleeps on (one at a time, reopened when the awaited key
    changes). Why: N nodes polling a round at a fixed rate were most of etcd's work in a
    re-form at 512 simulated nodes (bench/scale.py); watching, they read when the key they
    wait for is written, and otherwise ``watched_slowdown`` times less often than they
    polled. Without a watch (:class:`~resilient.etcd.watch.Watch` broken) they poll as before."""

    reopen = 30.0   # seconds after which a broken watch (etcd restarted) is tried again

    def __init__(self, handler: KeyedRendezvousHandler) -> None:
        self.h, self.key, self.watch, self.opened = handler, None, None, 0.0

    def until_changed(self, key: str, nodes_seen: int, after: int) -> None:
        """Sleep until ``key`` changes after revision ``after`` (the caller's last read) or a
        slowed poll interval passes."""
        interval = self.h._interval(nodes_seen)
        if self.key != key or (self.watch is not None and self.watch.broken
                               and time.monotonic() - self.opened > self.reopen):
            self.close()
            self.key, self.opened = key, time.monotonic()
            self.watch = Watch(self.h.client, key, after=after, fallback=timedelta(seconds=interval))
        assert self.watch is not None
        self.watch.wait(interval * self.h.settings.watched_slowdown)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        self.key, self.watch = None, None

    def __enter__(self) -> "_Waits":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LastCall:
    """When an open round is ready to close, as one node sees it: once ``max_nodes`` joined,
    or once ``min_nodes`` joined and no join came for ``last_call``. Each arrival restarts
    the call, so survivors straggling in over a loaded fleet are not left for another round;
    at most ``patience`` last calls after ``min_nodes`` were first seen. A node that is not
    the round's closer waits ``fallback`` last calls more (the closer may have died)."""

    patience, fallback = 10, 2

    def __init__(self, settings: KeyedSettings) -> None:
        self.s = settings
        self.count, self.changed, self.first_min = -1, 0.0, None

    def ready(self, count: int, now: float, closer: bool) -> bool:
        if count != self.count:
            self.count, self.changed = count, now
        if count < self.s.min_nodes:
            self.first_min = None
            return False
        if self.first_min is None:
            self.first_min = now
        call = self.s.last_call.total_seconds()
        if count >= self.s.max_nodes:
            since = 0.0 if closer else now - self.changed
            return closer or since >= self.fallback * call
        since = max(now - self.changed, (now - self.first_min) / self.patience)
        return since >= call * (1 if closer else 1 + self.fallback)


def _decode(value: str) -> bytes:
    return base64.b64decode(value)


def _node_order(name: str) -> tuple:
    """torch's rank order (its node descriptors sort by address, pid, local id)."""
    addr, pid, local = name.rsplit("_", 2)
    return addr, int(pid), int(local)


def _corrupt(key: str, e: BaseException):
    from resilient.rendezvous.api import RendezvousStateCorrupt

    return RendezvousStateCorrupt(
        f"the rendezvous record {key} fails authentication or is malformed ({e}); it was not used. Give every "
        f"node the same job secret; to start the job over, use a new run id or delete the key")
