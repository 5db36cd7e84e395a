"""The agent's replicator: local versions → peer RAM → commit records in etcd.

One daemon thread per agent, never in the training path, at the lowest CPU
priority (:mod:`.priority`). It sleeps on the store's doorbell (each rank
rings it after writing a version) and each turn takes the *newest* version
its workers finished writing into the node store (all of the node's ranks
have their rank manifest; older unfinished versions are skipped: coalescing,
as the durable uploader does) whose step is due under the budget (every
version, or every 2nd, ... when versions cost more than ``duty`` of the time
between them: :meth:`Replicator._budget`), and

1. pushes the node's rank files (parts first, rank manifest last) to
   ``k`` peers (:mod:`.placement`: other failure domains first, the load balanced,
   stable when a node leaves), rate-limited;
2. gathers every node's holds ("node N holds ranks R of step S on nodes [N, peers...]")
   and commits the version at tier ``local`` (``/resilient/<run>/commit/local/<S>``) and,
   when every rank is held on ``1+k`` nodes, at tier ``peer`` (``.../commit/replicated/<S>``),
   both create-only in one transaction; the winner emits ``commit``. How the holds are
   gathered is the replicator's commit protocol (:class:`~.api.CommitProtocol`, chosen by
   ``ReplicatorOptions.protocol``):

   * ``etcd`` (:mod:`.etcdcommit`): each node records them under
     ``/resilient/<run>/mem/holds/<S>/<N>`` and reads every node's record of S in one
     transaction, and whoever sees every rank covered commits: N + 1 writes per version and
     N² bytes read (bench/scale.py);
   * ``leader`` (:mod:`.leadcommit`; the agents' default; the replicator must serve its peer
     server, :meth:`Replicator.serve`, else it uses ``etcd``): the node holding rank 0
     chooses the version, every node handles that one (not its own newest) and reports its
     holds to that leader over the peer channel, and the leader alone commits: one etcd
     transaction per version whatever the node count.

   Before it commits, the agent checks that the version's rank manifests tile every tensor
   exactly once with one global shape (the check a restore and the durable committer
   make, :func:`~resilient.snapshot.format.merge_rank_manifests`): a version no
   restore could use is not committed (``upload_error``, ``phase = "commit"``, and
   one warning per worker group), and the run goes on with the durable tier.

Each etcd write is CPU taken from training on the host that makes it (etcd logs and fsyncs
every write).

A commit record (:class:`~resilient.snapshot.commits.CommitRecord`) says what restore needs
to find every shard, and the run's epoch it was made in (:mod:`.epoch`: a record a rollback
abandoned is refused even when put back). It is written once (create-only, fenced by the
epoch) so concurrent agents never disagree about a version.
Holds and commit records carry a MAC under the job secret bound to their key
(:mod:`resilient.secret`); one that fails is reported (``auth_failure``) and
ignored, so a forged record never selects a version or a holder.
``k`` is capped by the number of other live nodes (one node alone commits
with ``k = 0``).

Retention: the store keeps the newest ``keep`` versions plus the newest one
committed at a memory tier (never deleted while it is the newest) and the
newest one handled, so it is bounded at ``keep + 2`` versions, plus those
landing while the budget waits for a due one. Retired data files become the
store's spares (:class:`~resilient.snapshot.nodestore.Spares`). When tmpfs runs low the thread warns
(``upload_error`` with ``phase = "store_full"``) instead of failing.

Beside its commits the agent publishes, for its workers, what its newest version cost
(``push_bytes``, ``push_us``, ``commit_us`` in the store's committed file): the inputs of a
``snapshot.every = "auto"`` interval (:mod:`.interval`). Such versions lie at any step, so a
stride of 1 takes every version, whatever its step.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from resilient.errors import ConfigError
from resilient.secret import COMMIT, JobSecret, Unauthentic, report_unauthentic
from resilient.snapshot.api import CommitProtocol, SnapshotCorrupt, SnapshotIncomplete
from resilient.snapshot.auth import VersionAuth, object_macs, report as report_auth
from resilient.snapshot.epoch import EpochFence
from resilient.snapshot.format import merge_rank_manifests, object_crcs, rank_manifest_boxes, tiled_chunks, version_dir
from resilient.snapshot.nodestore import Doorbell, LocalVersion, NodeStore
from resilient.snapshot.peer import PeerClient, PeerError, SnapshotError
from resilient.snapshot.etcdcommit import EtcdCommit
from resilient.snapshot.leadcommit import LeaderCommit, group_of, leader_key  # noqa: F401 (leader_key: re-exported)
from resilient.snapshot.commits import (  # noqa: F401 (holds_prefix, read_commits re-exported)
    LOCAL, RECORD_TIERS, REPLICATED, CommitRecord, commit_key, commit_prefix, holds_prefix, read_commits)
from resilient.snapshot.placement import place, replica_order
from resilient.snapshot.priority import REPLICATION_NICE, background_priority

log = logging.getLogger(__name__)


@dataclass
class ReplicatorOptions:
    k: int = 1
    keep: int = 2
    rate: float = 0.0                       # bytes/s per push, 0 = unlimited
    # Budget (see Replicator._budget): the share of wall time the replicator may spend
    # handling versions, and the most steps between two versions it handles (1: every
    # version, at most one step lost per failure; 2: a failure may lose one step more).
    duty: float = 0.1
    max_stride: int = 1
    poll: timedelta = timedelta(milliseconds=50)      # listing the store, when it has no doorbell
    fallback: timedelta = timedelta(seconds=1)        # listing it anyway, between doorbell rings
    io_timeout: timedelta = timedelta(seconds=30)
    # The registry is read again after this, at every new worker group and after a failed
    # push: each read is etcd CPU on a host that trains (1 s: ~0.7 reads per demo step).
    nodes_ttl: timedelta = timedelta(seconds=10)
    # "etcd": every node records its holds in etcd (N + 1 writes per version, no leader);
    # "leader": the commit leader (rank 0's node) chooses the version, the others
    # handle that one and send their holds over the peer channel, one commit txn per version
    # (needs the node's PeerServer: Replicator.serve). Following the leader's choice is what
    # keeps it committing under load: nodes each skipping to their own newest version reported
    # holds of different versions, and the leader committed none (CI: the local tier stuck for
    # 90 s while training went on); leadcommit.py says more. The leader leads its worker
    # group's versions under one record (leadcommit.group_of): keyed per version, a follower
    # waited for records the leader never wrote for the versions it skipped, and the local
    # tier stalled again (tests/integration/test_metrics.py's two-node job, 2 runs in ~12; fixed). The
    # agents take it from ``snapshot.commit`` (default "leader"); "etcd" here for the
    # replicator built alone (the tests of the older protocol, and no PeerServer needed).
    protocol: str = "etcd"
    # How long the leader waits for every node's holds of a version before giving it up.
    gather_timeout: timedelta = timedelta(seconds=10)


class Replicator:
    """See the module docstring. ``nodes()`` returns the live nodes' registry info
    (``{node: {"domain", "store", ...}}``) or None when etcd is unreachable. How a version's
    holds are gathered and who commits it is its :attr:`protocol`
    (:class:`~resilient.snapshot.api.CommitProtocol`): etcd until :meth:`serve` gives it a
    peer server, then the one ``opts.protocol`` names."""

    def __init__(self, store: NodeStore, client, run_id: str, node: str, secret: JobSecret | bytes,
                 nodes: Callable[[], dict[str, dict] | None], opts: ReplicatorOptions, events: Any):
        self.store, self.client, self.run_id, self.node = store, client, run_id, node
        self.secret, self.nodes, self.opts, self.events = JobSecret.of(secret), nodes, opts, events
        self.auth = VersionAuth(self.secret)
        self.local_ranks: frozenset[int] = frozenset()
        self.world = 0
        self.done: int = -1                 # newest step handled
        self.since = 0.0                    # when the current worker group started
        self.old_groups: frozenset[str] = frozenset()  # attempt groups of versions older workers left
        self.group = 0                      # counts worker groups (set_workers): a version's work of an older one is dropped
        self.committed: dict[str, int] = {}  # tier -> newest step committed (seen by us)
        self._clients: dict[str, PeerClient] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._stride = 1                     # handle steps that are multiples of stride * unit
        self._unit = 0                       # the smallest step gap seen between versions (stride > 1)
        self._cost = 0.0                     # seconds per handled version (moving average)
        self._gap = 0.0                      # seconds between two versions landing (moving average)
        self._last: LocalVersion | None = None
        # The newest version's costs, published beside the commits for the workers' auto
        # intervals (resilient.snapshot.interval): bytes pushed, push and etcd commit microseconds.
        self._costs: dict[str, int] = {}
        self._urgent = False                 # preemption: the newest version, whatever the stride
        self._warned_full = 0.0
        self._warned_untiled = ""            # the attempt whose untiled versions were warned of
        self._nodes: dict[str, dict] = {}
        self._peer_committed = -1
        self._nodes_at = 0.0
        self._bell = Doorbell(store.path)
        self.protocol: CommitProtocol = EtcdCommit(self)  # LeaderCommit once serve() attached a peer server
        self._placement: dict[str, list[str]] = {}
        self._placed_for: dict[str, str] | None = None
        self._fence = EpochFence.start(client, run_id, self.secret, events)  # commits carry the run's epoch
        if opts.protocol not in ("leader", "etcd"):
            raise ConfigError(f"snapshot commit protocol {opts.protocol!r}: use 'leader' or 'etcd'")
        self._thread = threading.Thread(target=self._run, name="snapshot-replicator", daemon=True)
        self._thread.start()

    def serve(self, server) -> None:
        """Commit by the protocol ``opts.protocol`` names: with ``"leader"``, the holds peers
        report to this node (when it leads a commit) come in through ``server``, this node's
        :class:`~resilient.snapshot.peer.PeerServer`."""
        if self.opts.protocol == "leader":
            self.protocol = LeaderCommit(self, server)

    def set_workers(self, ranks: set[int], world: int) -> None:
        """The global ranks this node's workers now have (called at every worker start, after
        the old ones stopped)."""
        # Every version here now is an older worker group's (its workers are gone). Their
        # attempt groups, not only their times, rule them out: one that landed within the
        # slack below was otherwise handled as the new group's, and its leader waited out a
        # gather of holds that the other nodes' new groups never report.
        old = frozenset(group_of(v.attempt) for v in self.store.versions())
        with self._cond:
            # A new worker group: what the previous one left unfinished is not ours to commit.
            self.local_ranks, self.world = frozenset(ranks), world
            self.since, self.done, self.old_groups = time.time() - 0.5, -1, old
            self.group += 1       # a gather of the old group's version waiting for a lost node ends now
            self._nodes_at = 0.0  # the membership changed: read the registry afresh
            self._cond.notify_all()
        self._wake()

    def _wake(self) -> None:
        """Wake the loop, whether it waits on the condition or on the doorbell."""
        with self._cond:
            self._cond.notify_all()
        Doorbell.ring(self._bell.path)

    def _idle(self) -> None:
        """Wait for a version to land: a doorbell ring, or the store's listing interval."""
        if self._bell.sock is not None:
            self._bell.wait(self.opts.fallback)
        else:
            with self._cond:
                self._cond.wait(self.opts.poll.total_seconds())

    # -- the loop ---------------------------------------------------------------
    def _ready(self) -> list[LocalVersion]:
        """The versions this node's workers finished writing, not yet handled, oldest first."""
        with self._cond:
            mine, done, since, old = self.local_ranks, self.done, self.since, self.old_groups
        if not mine:
            return []
        return [v for v in self.store.versions()
                if mine <= v.ranks and v.step > done and v.mtime >= since and group_of(v.attempt) not in old]

    def _newest_ready(self) -> tuple[LocalVersion | None, LocalVersion | None]:
        """(the newest finished version not yet handled, the newest one due under the budget)."""
        with self._cond:
            urgent = self._urgent
            stride = 1 if self._stride <= 1 else self._stride * max(self._unit, 1)
        ready = self._ready()
        if not ready:
            return None, None
        # Stride 1 takes every version: with snapshot.every = "auto" their steps are not
        # multiples of one gap (the interval changes as the job runs), and a fixed interval's
        # versions all are. A stride > 1 (a fixed interval whose versions cost more than the
        # duty) keeps the multiples of stride × the gap, which every agent can agree on.
        due = [v for v in ready if urgent or stride <= 1 or v.step % stride == 0]
        return ready[-1], (due[-1] if due else None)

    def _run(self) -> None:
        background_priority(REPLICATION_NICE)
        skipped = -1
        while True:
            with self._cond:
                if self._stop:
                    return
            newest, v = self._newest_ready()
            if newest is not None:
                self._observe(newest)
                if self.protocol.following(newest.attempt):  # the leader protocol: the leader's choice, not ours
                    v = self.protocol.follow(newest)
                    if v is None:  # it waited, or gave versions up
                        continue
            if v is None:
                if newest is not None and newest.step > skipped:
                    skipped = newest.step  # older versions will never be handled: free their RAM
                    self._retain(below=newest.step - 1)
                self._idle()
                continue
            with self._cond:
                self._busy = True
                group = self.group
            t0 = time.monotonic()
            try:
                self._handle(v)
            except Exception as e:  # replication must never take the agent down
                log.warning("replicating step %d failed: %s", v.step, e)
                self._emit("upload_error", step=v.step, phase="replicate", error=f"{type(e).__name__}: {e}")
            finally:
                with self._cond:
                    if self.group == group:  # else a new group's restore may have gone back past it
                        self.done = max(self.done, v.step)
                    self._busy = False
                    self._cond.notify_all()
            self._retain(below=self.done)
            self._budget(time.monotonic() - t0)

    def _observe(self, v: LocalVersion) -> None:
        """Track how often versions land (their step gap and seconds apart)."""
        last, self._last = self._last, v
        if last is None or v.step <= last.step or v.mtime <= last.mtime:
            return
        gap = v.step - last.step
        self._unit = gap if self._unit <= 0 else min(self._unit, gap)
        per = (v.mtime - last.mtime) / (gap // max(self._unit, 1) or 1)
        self._gap = per if self._gap <= 0 else 0.7 * self._gap + 0.3 * per

    def _budget(self, spent: float) -> None:
        """Choose the stride that keeps the replicator within ``opts.duty`` of wall time.

        Why: on a host that trains, a version's push, its receipt on the peer and its etcd
        writes are CPU the training ranks do not get. When a version costs more than
        ``duty`` of the time between versions, only every ``stride``-th version is handled
        (a power of two up to ``max_stride``, on multiples of it: every agent estimates its
        stride alone, and multiples of the larger one are handled by all, so they commit).
        The cost is wall time, so a loaded host, a slow peer or a slow etcd all widen the
        stride. A preemption (:meth:`flush`) takes the newest version whatever the stride."""
        self._cost = spent if self._cost <= 0 else 0.7 * self._cost + 0.3 * spent
        duty, cap = self.opts.duty, max(1, self.opts.max_stride)
        stride = 1
        if 0 < duty < 1 and self._gap > 0:
            while stride < cap and self._cost > duty * stride * self._gap:
                stride *= 2
        with self._cond:
            self._stride = stride

    def _handle(self, v: LocalVersion) -> None:
        """Push this node's ranks of ``v`` to ``k`` peers, then record what is held where and
        commit (one txn to record and read every node's holds, one to commit both tiers):
        each etcd write here is CPU on a host that trains, every step."""
        mine = sorted(self.local_ranks & v.ranks)
        world = self.world
        try:  # what this node's workers signed, or nothing: a manifest put in their place is not spread
            docs = {r: self._own_manifest(v, r) for r in mine}
        except SnapshotError as e:
            report_auth(self.events, e)
            self._emit("upload_error", step=v.step, phase="replicate", obj=e.obj, error=f"{type(e).__name__}: {e}")
            return
        protocol = self.protocol
        protocol.begin(v)
        nodes = self._live_nodes()
        holders = {r: [self.node] for r in mine}
        parsed: dict[int, dict] = {}         # rank -> its manifest's JSON, parsed once (push, then commit)
        others = {n: i for n, i in nodes.items() if n != self.node and i.get("store")}
        k = min(self.opts.k, len(others))
        if k > 0:
            t0, sent = time.monotonic(), 0
            for peer in self._targets({**others, self.node: nodes.get(self.node, {})}):
                if sum(1 for n in holders[mine[0]] if n != self.node) >= k:
                    break
                try:
                    sent += self._push(peer, others[peer]["store"], v, mine, parsed, docs)
                except (PeerError, SnapshotError, OSError) as e:
                    self._drop_client(peer)
                    self._nodes_at = 0.0  # a peer failed: look at the registry afresh next time
                    self._emit("upload_error", step=v.step, phase="replicate", obj=peer, error=str(e))
                    continue
                for r in mine:
                    holders[r].append(peer)
            pushed = time.monotonic() - t0
            self._emit("upload", step=v.step, bytes=sent, stored_bytes=sent, parts=len(mine),
                       seconds=round(pushed, 4), tier="peer",
                       peers=sorted({n for h in holders.values() for n in h} - {self.node}))
            if sent > 0:
                self._costs.update(push_bytes=sent, push_us=max(1, round(pushed * 1e6)))
        protocol.commit(v, world, holders, docs, parsed, {LOCAL: 0, REPLICATED: k})

    def _targets(self, nodes: dict[str, dict]) -> list[str]:
        """Where this node pushes, in order (:mod:`.placement`: its placed targets in other
        domains, then fallbacks); the fleet's placement is recomputed only when the
        membership changes, from the previous one, so a node leaving moves only its replicas."""
        domains = {n: str(i.get("domain") or n) for n, i in nodes.items()}
        if domains != self._placed_for:
            self._placement = place(domains, self.opts.k, previous=self._placement)
            self._placed_for = domains
        return [n for n in replica_order(self.node, self._placement, domains) if n != self.node]

    def _live_nodes(self) -> dict[str, dict]:
        """The node registry, re-read at most every ``nodes_ttl`` (a version per step would
        otherwise cost a registry read per step); a failed push forces a fresh read."""
        now = time.monotonic()
        if now - self._nodes_at > self.opts.nodes_ttl.total_seconds():
            got = self.nodes()
            if got is not None:  # unreachable etcd: unknown is not dead, keep what we knew
                self._nodes, self._nodes_at = got, now
        return self._nodes

    def _client(self, peer: str, address: str) -> PeerClient:
        c = self._clients.get(peer)
        if c is None or c.address != address:
            c = self._clients[peer] = PeerClient(address, self.secret, self.opts.io_timeout, self.opts.rate)
        return c

    def _drop_client(self, peer: str) -> None:
        c = self._clients.pop(peer, None)
        if c is not None:
            c.close()

    def _own_manifest(self, v: LocalVersion, rank: int) -> bytes:
        """A rank manifest of this node's workers, read from the store and authenticated."""
        rel = f"{version_dir(v.step)}/{v.attempt}/r{rank:05d}.json"
        doc = self.store.read(rel)
        self.auth.open_manifest(doc, f"{self.store.path}/{rel}")
        return doc

    def _push(self, peer: str, address: str, v: LocalVersion, ranks: list[int],
              parsed: dict[int, dict] | None = None, docs: dict[int, bytes] | None = None) -> int:
        """Each rank's parts, then its manifest (which marks the rank whole on the peer).
        A part goes out with the CRC its chunks had when captured (from the manifest), so
        a copy damaged in this store is refused by the peer instead of replicated.
        Each manifest is parsed once per version, into ``parsed`` (the commit checks it too)."""
        c = self._client(peer, address)
        sent, parsed = 0, {} if parsed is None else parsed
        for r in ranks:
            *parts, mrel = self.store.rank_files(v.step, v.attempt, r)
            doc = docs[r] if docs is not None and r in docs else self.store.read(mrel)
            if r not in parsed:
                try:
                    parsed[r] = json.loads(doc)
                except ValueError:  # no CRCs to vouch for the parts; the commit check reports it
                    pass
            tiled = tiled_chunks(parsed[r]) if isinstance(parsed.get(r), dict) else {}
            crcs, macs = object_crcs(tiled=tiled), object_macs(tiled)
            for rel in parts:
                obj = rel.removeprefix(f"{version_dir(v.step)}/")
                sent += c.put_file(rel, self.store.file(rel), crcs.get(obj), macs.get(obj))
            c.put(mrel, doc)
            sent += len(doc)
        return sent

    # -- etcd records -----------------------------------------------------------
    def _authentic(self, purpose: str, kv, what: str) -> dict | None:
        key = kv.key.decode(errors="replace")
        try:
            return self.secret.open_record(purpose, key, kv.value)
        except Unauthentic as e:
            report_unauthentic(self.events, what, key, e)
            return None

    def _commit(self, v: LocalVersion, world: int, merged: dict[str, list[str]], tiers: dict[str, int],
                parsed: dict[int, dict] | None = None) -> None:
        """Commit ``v`` at each tier of ``tiers`` (tier -> k) whose ``1 + k`` copies of every
        rank are held and whose rank manifests tile every tensor (:meth:`_untiled`);
        create-only, so concurrent agents never disagree about a version."""
        due = {t: k for t, k in tiers.items()
               if len(merged) >= world and all(len(merged.get(str(r), [])) >= 1 + k for r in range(world))}
        if not due:
            return
        bad = self._untiled(v, world, merged, parsed if parsed is not None else {})
        if bad is not None:
            tier = "peer" if due.get(REPLICATED, 0) > 0 else LOCAL
            self._emit("upload_error", step=v.step, phase="commit", tier=tier, obj=bad.obj,
                       error=f"{type(bad).__name__}: {bad}")
            with self._cond:
                first, self._warned_untiled = self._warned_untiled != v.attempt, v.attempt
            (log.warning if first else log.debug)(
                "step %d is not committed to node RAM (no restore could use it), training goes on with the "
                "durable tier: %s", v.step, bad)
            return
        for _ in range(3):  # sealed in the epoch known; a rollback in between: learn it, again (.epoch)
            if self._fence.abandons(v.step, v.mtime):
                log.debug("step %d is not committed: a rollback abandoned it", v.step)
                return
            keys = {commit_key(self.run_id, t, v.step): t for t in due}
            made = self._fence.create({key: self.secret.seal_record(COMMIT, key, CommitRecord(
                v.step, v.attempt, world, merged, k=due[t], time=time.time(), epoch=self._fence.epoch.gen).to_doc())
                for key, t in keys.items()})
            if made is not None:
                break
        else:
            return
        won = {keys[key] for key in made}
        with self._cond:
            for t in due:
                self.committed[t] = max(self.committed.get(t, -1), v.step)
            if due.get(REPLICATED, 0) > 0:  # replicated to peers (k = 0: the local copy only)
                self._peer_committed = max(self._peer_committed, v.step)
        self._publish_committed()
        for t, k in due.items():
            if t in won and (t == LOCAL or k > 0):  # k = 0: the local commit said it all
                self._emit("commit", step=v.step, tier=LOCAL if t == LOCAL else "peer", world=world,
                           k=k, url=f"memory://{self.run_id}/{t}/{v.step}", holders=merged)
        if won and v.step % 16 == 0:
            self._forget_before(v.step - 32)

    def _untiled(self, v: LocalVersion, world: int, merged: dict[str, list[str]],
                 parsed: dict[int, dict]) -> SnapshotError | None:
        """Why no restore could use ``v``, or None: its rank manifests must tile every tensor
        exactly once with one global shape, as a restore's (and the durable committer's)
        :func:`~resilient.snapshot.format.merge_rank_manifests` demands. A layout bug that
        writes a box twice otherwise commits every version and fails every restore.

        Cost, per version on a host that trains: the manifests ``_push`` parsed are reused;
        the others are parsed from this node's store (the node's own ranks, and those peers
        pushed here), or read from a holder. Measured, 8 ranks of 156 tensors each: 6.4 ms
        (0.6 ms a rank to parse and build, 1.5 ms to merge); with ``manifest_from_json``, 11."""
        url = f"memory://{self.run_id}/step-{v.step}"
        vdir = version_dir(v.step)
        parts = []
        try:
            for r in range(world):
                rel = f"{vdir}/{v.attempt}/r{r:05d}.json"
                doc = parsed.get(r)
                if doc is None:
                    try:
                        doc = json.loads(self._rank_manifest(rel, merged.get(str(r), [])))
                    except ValueError as e:
                        raise SnapshotCorrupt(f"{url}: rank manifest of rank {r} is not JSON ({e})", rel) from None
                parts.append(rank_manifest_boxes(doc, f"{url}/{v.attempt}/r{r:05d}.json"))
            merge_rank_manifests(parts, url)
        except SnapshotError as e:
            return e
        return None

    def _rank_manifest(self, rel: str, holders: list[str]) -> bytes:
        """A rank manifest's bytes: from this node's store if it holds it, else from a live holder."""
        try:
            return self.store.read(rel)
        except (OSError, SnapshotError):  # not here (SnapshotIncomplete), or unreadable
            pass
        last: Exception | None = None
        for node in holders:
            address = self._nodes.get(node, {}).get("store")
            if node == self.node or not address:
                continue
            try:
                return self._client(node, address).get(rel)
            except (PeerError, SnapshotError, OSError) as e:
                self._drop_client(node)
                last = e
        raise SnapshotIncomplete(f"no holder of {rel} could serve it ({last or 'no live holder'})", rel)

    def _forget_before(self, step: int) -> None:
        """Delete commit and hold records of steps below ``step`` (one txn)."""
        if step <= 0:
            return
        ops = []
        for prefix in (*(commit_prefix(self.run_id, t) for t in RECORD_TIERS), f"/resilient/{self.run_id}/mem/holds/"):
            lo, hi = f"{prefix}{0:012d}", f"{prefix}{step:012d}"
            ops.append({"request_delete_range": {"key": base64.b64encode(lo.encode()).decode(),
                                                 "range_end": base64.b64encode(hi.encode()).decode()}})
        try:
            self.client.txn([], ops, [])
        except Exception as e:  # bookkeeping only
            log.debug("could not forget old commit records: %s", e)

    # -- what the leader protocol shares (leadcommit.py) -------------------------
    def _give_up(self, step: int) -> None:
        """Versions up to ``step`` are not handled (the leader will not gather them)."""
        with self._cond:
            self.done = max(self.done, step)
            self._cond.notify_all()
        self._retain(below=self.done)

    def _learn(self, shown: Any) -> None:
        """The newest commits the leader made (its reply to a report): kept by retention, shown
        to this node's workers."""
        if not isinstance(shown, dict):
            return
        with self._cond:
            for tier in RECORD_TIERS:
                if isinstance(shown.get(tier), int) and shown[tier] >= 0:
                    self.committed[tier] = max(self.committed.get(tier, -1), shown[tier])
            if isinstance(shown.get("peer"), int):
                self._peer_committed = max(self._peer_committed, shown["peer"])
        self._publish_committed()

    def _shown(self) -> dict[str, int]:
        with self._cond:
            return {**{t: self.committed.get(t, -1) for t in RECORD_TIERS}, "peer": self._peer_committed}

    # -- retention --------------------------------------------------------------
    def _retain(self, below: int) -> None:
        # Only versions at or below ``below`` (the newest one handled, or one older than a
        # version the budget skips to) are candidates: a newer step directory may still be
        # landing (no rank manifest yet), and must not be touched.
        with self._cond:
            # The newest version handled stays too: our holds record of it may still become
            # a commit (another node's txn reads it), which must not name deleted bytes.
            committed = set(self.committed.values()) | {self.done}
        steps = sorted({v.step for v in self.store.versions() if v.step <= below})
        keep = set(steps[-self.opts.keep:]) | committed
        removed = self.store.retain(keep, below=below)
        try:
            free = self.store.free_bytes()
        except OSError:
            return
        # Calibrated on this job's own versions: the next one needs what the newest took (less the
        # retired files it rewrites in place); a fixed threshold warned every 30 s on a 64 MB
        # /dev/shm where a small job's versions land fine.
        need = self.store.version_bytes(steps[-1]) - self.store.spares.bytes() if steps else 0
        if free < need and time.monotonic() - self._warned_full > 30:
            self._warned_full = time.monotonic()
            self._emit("upload_error", step=self.done, phase="store_full", obj=str(self.store.path),
                       error=f"node store {self.store.path} has {free >> 20} MiB left, less than a version of this "
                             f"job takes ({need >> 20} MiB); versions will fail to land in RAM (training goes on). "
                             "Enlarge /dev/shm or lower snapshot.store_keep")
        del removed

    # -- control ----------------------------------------------------------------
    def flush(self, timeout: timedelta) -> bool:
        """Wait until the newest finished version is handled (preemption: before leaving)."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:  # leaving: the newest version must not wait for the budget
            self._urgent = True
        self._wake()
        while time.monotonic() < deadline:
            v, _ = self._newest_ready()
            with self._cond:
                if v is None and not self._busy:
                    return True
                self._cond.wait(0.05)
        return False

    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        with self._cond:
            self._stop = True
        self._wake()
        self._thread.join(timeout.total_seconds())
        self._bell.close()
        for peer in list(self._clients):
            self._drop_client(peer)

    def _publish_committed(self) -> None:
        """Tell this node's workers the newest commit per tier they restore from (local, peer)
        and what the newest version cost (the store's committed file); call without ``_cond``."""
        with self._cond:
            newest = {LOCAL: self.committed.get(LOCAL, -1), "peer": self._peer_committed}
        self.store.publish_committed({**self._costs, **{k: s for k, s in newest.items() if s >= 0}})

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)
