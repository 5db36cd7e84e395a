"""Which nodes are alive: one key per node in etcd, held by a liveness lease.

``/resilient/<run>/nodes/<node>`` holds the node's description (id, failure
domain, host, pid) and lives exactly as long as the node's lease: an agent
that dies (or is partitioned from etcd) loses its key ``ttl`` later, and a
node that leaves on purpose revokes its lease, deleting the key at once.
Agents compare the nodes of their current rendezvous round with the live
keys: a member whose key is gone means the round is broken, and the agent
restarts its workers instead of letting them wait out a collective timeout.

A description also carries the node's name in the rendezvous state
(``rdzv``) and its snapshot server's address (``store``), so that
:meth:`NodeRegistry.proven_dead` can tell a dead agent from a slow one:
a port that refuses connections on a host that answers is a dead process,
and the rendezvous evicts it at once instead of after its keep-alive lapses.

Every description carries a MAC under the job secret (bound to its key,
:mod:`resilient.secret`); :func:`read_registry` drops one that fails (reported
as ``auth_failure``), so a forged entry never names a peer, a store address
or a live node, and a forged holder of our node id is overwritten.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psutil

from resilient.agent.api import NodeIdInUse
from resilient.etcd import EtcdClient, EtcdError, LivenessLease
from resilient.secret import (
    REGISTRY, JobSecret, SecretMismatch, Unauthentic, read_records, report_unauthentic, require_secret,
)

log = logging.getLogger(__name__)

PURPOSE = REGISTRY


def registry_prefix(run_id: str) -> str:
    return f"/resilient/{run_id}/nodes/"


def exchange_node_ids(store: Any, rank: int, world: int, node_id: str) -> list[str]:
    """Every node's id, by rank, through the round's store: each node writes its own key,
    rank 0 reads them all (one read of N keys per poll) and writes the list once, and the
    others wait for that one key. Every node reading every key would be N² reads a poll."""
    store.set(f"resilient/node/{rank}", node_id)
    if rank == 0:
        ids = [v.decode() for v in store.multi_get([f"resilient/node/{r}" for r in range(world)])]
        store.set("resilient/nodes", json.dumps(ids))
        return ids
    ids = json.loads(store.get("resilient/nodes"))
    if not (isinstance(ids, list) and len(ids) == world and all(isinstance(i, str) for i in ids)):
        raise ValueError(f"the round's node list is malformed: {ids!r:.200}")
    return ids


def read_registry(client: EtcdClient, run_id: str, secret: JobSecret | bytes, events: Any = None) -> dict[str, dict]:
    """node id → description of every registered node whose entry authenticates (raises EtcdError)."""
    return read_records(client, registry_prefix(run_id), PURPOSE, secret, events, "node registry entry")


class RegistryReader:
    """:func:`read_registry` for a reader that asks often (the replicator, for each
    version): one small request tells what changed since the last read, and only the
    entries added or changed since are read and checked (plus the bare keys when some were
    removed). Every node reading the whole registry per version is N² records a step
    across a fleet; re-reading it whole after each change (a node lost or joined) was N²
    records per change (bench/scale.py at 256 nodes: 28 MB out of etcd per change)."""

    def __init__(self, client: EtcdClient, run_id: str, secret: JobSecret | bytes, events: Any = None):
        self.client, self.run_id, self.secret, self.events = client, run_id, JobSecret.of(secret), events
        self._nodes: dict[str, dict] = {}   # the authentic entries
        self._present: set[str] = set()     # every key there, authentic or not (the count's)
        self._bad: set[str] = set()         # there, but unauthentic at their last change
        self._revision = 0

    def __call__(self) -> dict[str, dict]:
        prefix = registry_prefix(self.run_id)
        count, changed, revision = self.client.prefix_since(prefix, self._revision)
        if revision < self._revision:  # another etcd (restored from an older snapshot, wiped): read afresh
            self._nodes, self._present, self._bad, self._revision = {}, set(), set(), 0
            count, changed, revision = self.client.prefix_since(prefix, 0)
        for kv in changed:
            key = kv.key.decode(errors="replace")
            name = key.removeprefix(prefix)
            self._present.add(name)
            try:
                self._nodes[name] = self.secret.open_record(PURPOSE, key, kv.value)
                self._bad.discard(name)
            except Unauthentic as e:  # a forged overwrite is not the entry any more
                self._nodes.pop(name, None)
                self._bad.add(name)
                report_unauthentic(self.events, "node registry entry", key, e)
        if count != len(self._present):  # some were removed: which, from the bare keys
            self._present = {k.decode(errors="replace").removeprefix(prefix) for k in self.client.prefix_keys(prefix)}
            self._nodes = {n: d for n, d in self._nodes.items() if n in self._present}
            self._bad &= self._present
        elif self._present - self._nodes.keys() - self._bad:
            # A key whose value this reader never saw, unchanged since its last read: only an etcd
            # whose revisions went back and caught up between two reads (an older snapshot). Afresh.
            self._nodes, self._present, self._bad, self._revision = {}, set(), set(), 0
            return self()
        self._revision = revision
        return dict(self._nodes)


def full_check_due(node_id: str, check: int, members: int, full_every: int) -> bool:
    """Whether ``node_id``'s ``check``-th node-loss check reads every entry: one check in
    max(``full_every``, members / 8), at a phase of the node's own (its id's hash)."""
    period = max(full_every, members // 8)
    return (check + zlib.crc32(node_id.encode()) % period) % period == 0


class NodeRegistry:
    """``secret``: the job secret (default: from the environment, :func:`resilient.secret.require_secret`)."""

    def __init__(self, client: EtcdClient, run_id: str, node_id: str, domain: str, ttl: timedelta,
                 secret: JobSecret | bytes | None = None, events: Any = None, confirm: timedelta | None = None):
        """``confirm``: a node whose key lapsed is lost only with a second signal (its agent's pid
        gone from this host, its port refusing: :meth:`gone_for_sure`) or once missing this long;
        None: two misses in a row are enough."""
        self.client = client
        self.confirm = confirm
        self._missing_since: dict[str, float] = {}
        self.run_id = run_id
        self.secret = JobSecret.of(secret) if secret is not None else require_secret(what="the node registry")
        self.events = events
        self.prefix = registry_prefix(run_id)
        self.node_id = node_id
        # "secret": the secret's fingerprint (a name, not the secret): an agent launched with
        # another secret is told so at once (:meth:`refuse_other_secrets`)
        self.info = {"node": node_id, "domain": domain or node_id, "host": socket.gethostname(),
                     "pid": os.getpid(), "since": time.time(), "secret": self.secret.fingerprint}
        self.lease = LivenessLease(client, ttl)
        self._missing: dict[str, int] = {}
        self._checks = 0                              # lost() calls: every few is a full read
        self._stores: dict[str, str] = {}             # rdzv name -> store address, from the last full read
        self._everyone = RegistryReader(client, run_id, self.secret, events)  # the full reads, incremental
        self._ids: dict[str, str] = {}                # rdzv name -> node id, of this node's round
        self.seen: dict[str, dict] = {}               # node id -> its last authentic entry (gone_for_sure)

    def update(self, **info) -> None:
        """Add fields to this node's description (e.g. its store address) and re-publish it."""
        self.info.update(info)
        self.register()

    def claim(self, wait: timedelta | None = None, **info) -> None:
        """Publish this node's description only if no live agent holds the node id.

        Why not a plain put: a second agent started with the same --node-id would
        overwrite the live node's key under its own lease, and delete it on exit;
        the live node then looks gone, and a node with another config passes
        the job check. The key is created only where absent (one txn). A holder
        that is a dead process of this host (an agent killed with -9, its lease
        not lapsed yet) is taken over at once; any other holder is given ``wait``
        (default: the lease ttl) to lapse before :class:`NodeIdInUse` is raised."""
        self.info.update(info)
        key = self.prefix + self.node_id
        deadline = time.monotonic() + (wait or self.lease.ttl).total_seconds() + 1.0
        seen = None
        while True:
            got = self.client.compare_and_swap(key, self._sealed(), mod_revision=seen, lease=self.lease.id)
            if got.succeeded:
                try:
                    self.refuse_other_secrets()
                except SecretMismatch:
                    self.leave()   # our claim must not hold the node id for a lease ttl
                    raise
                return
            if got.kv is None:  # gone between the compare and now: create it
                seen = None
                continue
            try:
                holder = self.secret.open_record(PURPOSE, key, got.kv.value)
            except Unauthentic as e:  # not written by an agent of this job: not a holder
                report_unauthentic(self.events, "node registry entry", key, e)
                seen = got.kv.mod_revision
                continue
            pid = holder.get("pid")
            if holder.get("host") == socket.gethostname() and isinstance(pid, int) and not psutil.pid_exists(pid):
                seen = got.kv.mod_revision  # take it over, unless it changes meanwhile
                continue
            if time.monotonic() > deadline:
                raise NodeIdInUse(
                    f"node id {self.node_id!r} is in use in this run by a live agent (pid {holder.get('pid')} "
                    f"on host {holder.get('host')!r}); give this node another --node-id, or stop that agent first")
            seen = None
            time.sleep(0.5)

    def refuse_other_secrets(self) -> None:
        """Raise :class:`~resilient.secret.SecretMismatch` when another live agent of this run
        holds another job secret: its entry fails our MAC and names another fingerprint.

        A launch with the wrong secret file would otherwise only log ``auth_failure`` (each
        agent refuses the other's records) until a rendezvous timed out. The fingerprint is
        unauthenticated (that is the point: we cannot check the other's MAC), so a writer of
        etcd can make a launch stop here; it can deny service in plainer ways too, and it can
        never make a forged record count."""
        theirs: dict[str, str] = {}
        for kv in self.client.get_prefix(self.prefix):
            key = kv.key.decode(errors="replace")
            if key == self.prefix + self.node_id:
                continue
            try:
                self.secret.open_record(PURPOSE, key, kv.value)
                continue
            except Unauthentic:
                pass
            try:
                doc = json.loads(kv.value)
            except (ValueError, UnicodeDecodeError):
                continue
            fp = doc.get("secret") if isinstance(doc, dict) else None
            if isinstance(fp, str) and fp != self.secret.fingerprint:
                theirs[key.removeprefix(self.prefix)] = fp[:64]
        if theirs:
            raise SecretMismatch(
                f"node(s) {sorted(theirs)} of run {self.run_id!r} hold a job secret with fingerprint "
                f"{sorted(set(theirs.values()))}, this node's (from {self.secret.source}) has fingerprint "
                f"{self.secret.fingerprint}: their records and this node's cannot authenticate each other. Give "
                "every node the same secret (the same --secret-file, $RESILIENT_JOB_SECRET_FILE or "
                "$RESILIENT_JOB_SECRET), then relaunch this node")

    def _sealed(self) -> str:
        return self.secret.seal_record(PURPOSE, self.prefix + self.node_id, self.info)

    def register(self) -> None:
        self.client.put(self.prefix + self.node_id, self._sealed(), lease=self.lease.id)

    def alive(self) -> dict[str, dict] | None:
        """node id → description of every live node; None when etcd is unreachable
        (unknown is not dead: an etcd outage must not look like a node loss)."""
        try:
            nodes = self._everyone()
        except EtcdError as e:
            log.debug("node registry unreachable: %s", e)
            return None
        self._stores = {d.get("rdzv"): d.get("store") for n, d in nodes.items() if n != self.node_id}
        self.seen.update(nodes)
        return self._ours_back(nodes)

    def _ours_back(self, nodes: dict[str, dict]) -> dict[str, dict]:
        if self.node_id not in nodes:
            # Our lease lapsed during an outage (or a forged entry took our key): put it back.
            try:
                self.register()
            except EtcdError:
                pass
        return nodes

    def lost(self, members: set[str], neighbours: int = 0) -> set[str]:
        """Members whose key has been missing on two checks in a row (one
        miss can be a key being re-registered after an etcd restart).

        ``neighbours`` > 0: look only at that many members after this node in the
        ring of node ids, and at all of them every :attr:`full_every` calls (N/8 beyond 80
        nodes: a safety net for neighbours lost together), each node at its own phase of
        that period (a node id's hash): started together, N nodes reading N entries at
        once would be a burst of N² records every period (256 nodes: 20 MB). Every
        agent reading every entry each check is N² records a second across a fleet
        (512 nodes: ~75 MB/s out of etcd); with a ring each node is watched by
        ``neighbours`` others, and the one that sees it go makes the whole job
        re-form (its rendezvous moves to the next round, which every agent sees).
        A full check reads only the entries changed since this node's previous one
        (:class:`RegistryReader`): after the first, it costs the churn, not N entries."""
        self._checks += 1
        # Full checks come at each node's own phase of the period, the first one too: nodes
        # started together reading everyone at once would be a burst of N² records (512
        # nodes: ~110 MB); after its first, a node's full checks read only what changed.
        if 0 < neighbours < len(members) and not self.full_due(len(members)):
            ring = sorted(members | {self.node_id})
            me = ring.index(self.node_id)
            watched = {ring[(me + i) % len(ring)] for i in range(1, neighbours + 1)} - {self.node_id}
            nodes = self._read(sorted(watched))
            members = watched
        else:
            nodes = self.alive()
        if nodes is None:
            return set()
        gone = set()
        now = time.monotonic()
        for m in members:
            if m in nodes:
                self._missing.pop(m, None)
                self._missing_since.pop(m, None)
            else:
                self._missing[m] = self._missing.get(m, 0) + 1
                self._missing_since.setdefault(m, now)
                if self._missing[m] >= 2:
                    gone.add(m)
        if self.confirm is None or not gone:
            return gone
        # A lapsed lease alone is a stalled agent as often as a dead one (a loaded host, a long
        # GC pause): lost only with a second signal, or once missing past the bound.
        late = {m for m in gone if now - self._missing_since[m] >= self.confirm.total_seconds()}
        return late | self.gone_for_sure(gone - late)

    full_every = 10  # lost(neighbours=k): every this many checks, all members

    def full_due(self, members: int) -> bool:
        """Whether the check being made (``_checks``, counted) reads every entry."""
        return full_check_due(self.node_id, self._checks, members, self.full_every)

    def _read(self, node_ids: list[str]) -> dict[str, dict] | None:
        """The authentic entries of ``node_ids`` (and ours, put back if missing), in one read."""
        keys = [self.prefix + n for n in [*node_ids, self.node_id]]
        try:
            kvs = self.client.get_many(keys)
        except EtcdError as e:
            log.debug("node registry unreachable: %s", e)
            return None
        nodes = {}
        for key, kv in zip(keys, kvs):
            if kv is None:
                continue
            try:
                nodes[key[len(self.prefix):]] = self.secret.open_record(PURPOSE, key, kv.value)
            except Unauthentic as e:
                report_unauthentic(self.events, "node registry entry", key, e)
        self.seen.update(nodes)
        return self._ours_back(nodes)

    def proven_dead(self, names: list[str], timeout: timedelta = timedelta(seconds=0.5)) -> set[str]:
        """The rendezvous names (``rdzv``) among ``names`` whose agent is certainly gone:
        its snapshot server refuses connections. A timeout, an unknown name or an
        unreachable etcd proves nothing (a partition, a slow host, an outage)."""
        # Known from the last full read (the membership checks make one now and then), or read
        # for these names alone (their node ids from the round, :meth:`know_round`): at a
        # re-form every agent reading every entry would be N² records.
        stores = self._stores
        if not all(n in stores for n in names):
            if all(n in self._ids for n in names):
                nodes = self._read([self._ids[n] for n in names])
                stores = {d.get("rdzv"): d.get("store") for d in (nodes or {}).values()}
            elif self.alive() is None:
                return set()
            else:
                stores = self._stores
        targets = [n for n in names if stores.get(n)]
        if len(targets) <= 1:
            return {n for n in targets if refuses_connections(stores[n], timeout)}
        # In parallel: a partitioned member costs its whole timeout, and a join waits for all.
        with ThreadPoolExecutor(min(len(targets), 16), thread_name_prefix="probe") as pool:
            verdicts = list(pool.map(lambda n: refuses_connections(stores[n], timeout), targets))
        return {n for n, dead in zip(targets, verdicts) if dead}

    def gone_for_sure(self, node_ids: set[str], timeout: timedelta = timedelta(seconds=0.5)) -> set[str]:
        """The nodes among ``node_ids`` whose agent is certainly gone, from what their last entry
        said (no etcd needed: it may be the thing that is gone): its pid is no process of this
        host, or its snapshot server refuses connections. A node never seen, or one that only
        does not answer (slow, partitioned), is not."""
        dead = set()
        for node in sorted(node_ids - {self.node_id}):
            doc = self.seen.get(node)
            if doc is None:
                continue
            pid = doc.get("pid")
            if doc.get("host") == socket.gethostname() and isinstance(pid, int) and not psutil.pid_exists(pid):
                dead.add(node)
            elif doc.get("store") and refuses_connections(doc["store"], timeout):
                dead.add(node)
        return dead

    def know_round(self, rdzv_names: list[str], node_ids: list[str]) -> None:
        """This node's round: its members' rendezvous names and node ids, both by rank."""
        self._ids = dict(zip(rdzv_names, node_ids)) if len(rdzv_names) == len(node_ids) else {}

    def leave(self) -> None:
        """Revoke the lease: our key disappears now, not ``ttl`` later."""
        try:
            self.lease.close(revoke=True)
        except EtcdError as e:
            log.warning("could not revoke the node lease: %s", e)


def refuses_connections(address: str, timeout: timedelta) -> bool:
    """True when ``host:port`` actively refuses a TCP connection (nothing listens there)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout.total_seconds()):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
