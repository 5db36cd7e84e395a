"""The memory tiers' commit, led by one node: holds gathered over the peer channel.

Why: with every node recording its holds in etcd (the replicator's ``etcd`` protocol) a
version costs N + 1 etcd writes, and every node reads all N records back (N² bytes per
version): measured with bench/scale.py, 139 writes and 6.8 MB of etcd traffic per version
at 128 nodes, commit latency 2.5 s. Here a version costs one etcd transaction (the commit
records of both tiers, created together) whatever N is, and etcd carries no holds at all.

The protocol, per worker group (attempt) and version:

1. The node holding global rank 0 claims the lead of the attempt once, with a create-only
   record ``/resilient/<run>/mem/leader/<attempt>`` naming it and its peer server (MAC'd
   under the job secret). Two nodes claiming rank 0 (an old group's and a new one's) race
   there: one leads, the other reports to it like any node.
2. The leader chooses the version: its newest one due (its replicator's own choice), which it
   announces as its *target* before it pushes its replicas. Every other node follows: when a
   version lands it asks the leader for its target over the authenticated peer channel
   (``target`` op: the leader answers as soon as it has chosen a step newer than the one the
   node handled last, or after ``fallback``), and handles that version, not its own newest.
   Why the leader chooses: each replicator skips to its newest version when it is behind, so
   under load the nodes, each at its own pace, handled different versions, and the leader
   gathered holds that never all came (CI: the local tier stuck for 90 s while training went
   on). Why not "the newest version every node reported": nodes skipping at their own pace
   handle nearly disjoint sets of versions, and that newest common one is rare under load.
   Following, every turn of the leader is one commit, paced by the slowest node.
   A follower whose newest version is older than the target gives its versions up (the leader
   never gathers them) and waits for the target to land; a target that never landed here, or
   is not whole, is given up too (the leader gives it up after ``gather_timeout``).
3. Each follower, after pushing its replicas, reports its holds of the target (which ranks
   it holds, on which nodes, and its rank manifests) to the leader (``holds`` op); the reply
   carries the newest commits the leader made, which the node keeps (retention) and shows
   to its workers (as does the answer to its ``target`` question).
4. The leader waits up to ``gather_timeout`` for holds covering every rank, checks that
   the manifests tile every tensor, and commits (the replicator's ``_commit``).

Failures: a node that never reports leaves the version uncommitted (``upload_error``,
``phase = "commit"``, naming the ranks) and the next version is tried afresh; a leader lost
mid-commit commits nothing (the questions and reports to it fail and are reported, and the
node gives its pending versions up), and the re-formed group's new rank 0 leads the new
attempt. Nothing is committed without every rank held.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

from resilient.secret import HOLDS
from resilient.snapshot.api import CommitProtocol, SnapshotError
from resilient.snapshot.commits import merge_holds
from resilient.snapshot.nodestore import LocalVersion
from resilient.snapshot.peer import PeerError

if TYPE_CHECKING:
    from resilient.snapshot.memcommit import Replicator

log = logging.getLogger(__name__)


def leader_key(run_id: str, attempt: str) -> str:
    return f"/resilient/{run_id}/mem/leader/{group_of(attempt)}"


def group_of(attempt: str) -> str:
    """The worker group of a version's attempt directory (``<group>-<seq>``, durable.py): a
    leader leads its group's versions, all of them. Keyed by the directory itself, each
    version had a leader record of its own, claimed only for the versions the leader took
    up: a follower whose newest version the leader skipped waited for a record that never
    came, asked for a target under another key, and no version was committed again
    (tests/integration/test_metrics.py's two-node job: the local tier stuck at step 15 for 90 s)."""
    head, sep, seq = attempt.rpartition("-")
    return head if sep and len(seq) == 6 and seq.isdigit() else attempt


class LeaderCommit(CommitProtocol):
    """The leader protocol (module doc) for ``rep``'s node, which serves ``server`` (its
    :class:`~resilient.snapshot.peer.PeerServer`: the followers' questions and reports come
    in there). Its own state: the leaders it knows, the version it gathers now (leading) and
    the holds reported to it. The replicator's it shares: its condition (a new worker group
    ends a gather), its ranks, group and handled step, its etcd and peer clients; it commits
    through :meth:`Replicator._commit <resilient.snapshot.memcommit.Replicator._commit>`."""

    def __init__(self, rep: "Replicator", server):
        self.rep, self.server = rep, server
        self._leaders: dict[str, tuple[str, str]] = {}  # attempt group -> (leader node, its store address)
        self._target: tuple[str, int] = ("", -1)  # leading: (attempt group, step) of the version gathered now
        self._reports: dict[tuple[int, str], dict[str, dict]] = {}  # (step, attempt) -> node -> holds
        self._leading = False  # whether this node leads the version handled now (begin)
        server.on_holds = self._on_holds
        server.on_target = self._on_target

    # -- CommitProtocol ----------------------------------------------------------
    def following(self, attempt: str) -> bool:
        try:
            return not self._leads(attempt)
        except Exception as e:  # etcd unreachable for the claim: begin claims again, and reports it
            log.debug("could not claim the commit lead of %s: %s", attempt, e)
            return False

    def begin(self, v: LocalVersion) -> None:
        self._leading = self._leads(v.attempt)
        if self._leading:
            self._aim(v)  # the followers learn it now and push their replicas while we push ours

    def commit(self, v: LocalVersion, world: int, holders: dict[int, list[str]], manifests: dict[int, bytes],
               parsed: dict[int, dict], tiers: dict[str, int]) -> None:
        rep = self.rep
        doc = {"node": rep.node, "step": v.step, "attempt": v.attempt, "world": world,
               "holders": {str(r): h for r, h in holders.items()}}
        if self._leading:
            # this node's own manifests as parsed for the push (not again: ~1.7 ms per demo
            # rank, the leader's largest cost per version after the push; py-spy of an agent)
            own = {r: parsed[r] for r in manifests if r in parsed}
            for r, text in manifests.items():
                if r not in own:
                    try:
                        own[r] = json.loads(text)
                    except ValueError:   # the tiling check reads it from a holder instead
                        pass
            merged, reported = self._gather(v, doc, world, own)
            if merged is not None:
                t0 = time.monotonic()
                rep._commit(v, world, merged, tiers, reported)
                rep._costs["commit_us"] = round((time.monotonic() - t0) * 1e6)
        else:
            self._report(v, {**doc, "manifests": {str(r): text.decode() for r, text in manifests.items()}})

    # -- the lead -----------------------------------------------------------------
    def _leads(self, attempt: str) -> bool:
        """Whether this node leads the commits of ``attempt``: it holds global rank 0 and its
        create-only leader record won (two nodes both claiming rank 0, an old group's and a
        new one's, race there: one leads, the other reports to it)."""
        if 0 not in self.rep.local_ranks:
            return False
        group = group_of(attempt)   # the key of _leaders; leader_key derives it itself
        if group not in self._leaders:
            key = leader_key(self.rep.run_id, attempt)
            address = self.server.address
            got = self.rep.client.compare_and_swap(
                key, self.rep.secret.seal_record(HOLDS, key, {"node": self.rep.node, "store": address}), mod_revision=None)
            if got.succeeded:
                self._leaders[group] = (self.rep.node, address)
            elif got.kv is not None:
                self._remember_leader(group, got.kv)
        return self._leaders.get(group, ("", ""))[0] == self.rep.node

    def _remember_leader(self, group: str, kv) -> None:
        rec = self.rep._authentic(HOLDS, kv, "commit leader record")
        if rec is not None and isinstance(rec.get("node"), str) and isinstance(rec.get("store"), str):
            self._leaders[group] = (rec["node"], rec["store"])

    def _leader(self, attempt: str) -> tuple[str, str] | None:
        """The leader of ``attempt`` (node, store address); waits for it to announce itself
        (its first version of the attempt may land after ours), up to ``gather_timeout``."""
        deadline = time.monotonic() + self.rep.opts.gather_timeout.total_seconds()
        delay = 0.01
        group = group_of(attempt)   # the key of _leaders; leader_key derives it itself
        workers = self.rep.group        # a new worker group: this attempt's leader is moot
        while group not in self._leaders:
            kv = self.rep.client.get(leader_key(self.rep.run_id, attempt))
            if kv is not None:
                self._remember_leader(group, kv)
            if group in self._leaders or time.monotonic() > deadline or self.rep.group != workers:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return self._leaders.get(group)

    def _report(self, v: LocalVersion, doc: dict) -> None:
        """Send this node's holds of ``v`` to the leader; its reply says what it committed."""
        leader = self._leader(v.attempt)
        if leader is None:
            self.rep._emit("upload_error", step=v.step, phase="commit", error=(
                f"no commit leader announced for attempt {v.attempt} within "
                f"{self.rep.opts.gather_timeout.total_seconds():.0f} s (the node with rank 0 is gone or slow)"))
            return
        node, address = leader
        t0 = time.monotonic()
        try:
            reply = self.rep._client(node, address).report_holds(doc)
        except (PeerError, SnapshotError, OSError) as e:
            self.rep._drop_client(node)
            self.rep._emit("upload_error", step=v.step, phase="commit", obj=node, error=str(e))
            return
        self.rep._costs["commit_us"] = round((time.monotonic() - t0) * 1e6)  # this node's share of the commit
        self.rep._learn(reply.get("committed"))

    # -- the version: the leader's choice, the followers' following -------------
    def _aim(self, v: LocalVersion) -> None:
        """The leader's choice: ``v`` is the version it gathers now (the followers asking learn it,
        and push their replicas of it while the leader pushes its own)."""
        with self.rep._cond:
            self._target = (group_of(v.attempt), v.step)
            self.rep._cond.notify_all()

    def _on_target(self, req: dict) -> dict:
        """A follower's question (a server thread; the channel authenticated it): the step of
        its attempt this leader gathers, once newer than its ``after``, waiting up to its
        ``wait`` (capped below the follower's socket timeout) for the leader to choose one."""
        try:
            attempt, after, wait = str(req["attempt"]), int(req["after"]), float(req.get("wait", 0))
        except (KeyError, TypeError, ValueError):
            return {"target": -1, "committed": self.rep._shown()}
        deadline = time.monotonic() + max(0.0, min(wait, self.rep.opts.io_timeout.total_seconds() / 2))
        with self.rep._cond:
            while True:
                step = self._target[1] if self._target[0] == group_of(attempt) else -1
                left = deadline - time.monotonic()
                if step > after or left <= 0 or self.rep._stop:
                    break
                self.rep._cond.wait(left)
        return {"target": step, "committed": self.rep._shown()}

    def follow(self, newest: LocalVersion) -> LocalVersion | None:
        """A follower's turn, ``newest`` its newest version not handled: the version the leader
        gathers, when this node has it whole; else None, after waiting for the leader to choose
        (up to ``fallback``) or giving up the versions the leader will never gather."""
        try:
            leader = self._leader(newest.attempt)
            if leader is None:
                self.rep._emit("upload_error", step=newest.step, phase="commit", error=(
                    f"no commit leader announced for attempt {newest.attempt} within "
                    f"{self.rep.opts.gather_timeout.total_seconds():.0f} s (the node with rank 0 is gone or slow)"))
                self.rep._give_up(newest.step)
                return None
            node, address = leader
            try:
                reply = self.rep._client(node, address).commit_target(newest.attempt, self.rep.done, self.rep.opts.fallback)
            except (PeerError, SnapshotError, OSError) as e:
                self.rep._drop_client(node)
                self.rep._emit("upload_error", step=newest.step, phase="commit", obj=node, error=str(e))
                self.rep._give_up(newest.step)
                return None
        except Exception as e:  # etcd unreachable (the leader's record): as a failed version
            self.rep._emit("upload_error", step=newest.step, phase="commit", error=f"{type(e).__name__}: {e}")
            self.rep._give_up(newest.step)
            return None
        self.rep._learn(reply.get("committed"))
        target = reply.get("target")
        if not isinstance(target, int) or target <= self.rep.done:
            # Nothing newer chosen within the wait (or a leader stopping): ask again, unhurried.
            with self.rep._cond:
                self.rep._cond.wait(self.rep.opts.poll.total_seconds())
            return None
        if target > newest.step:  # not landed here yet; ours older than it will never be gathered
            self.rep._give_up(newest.step)
            return None
        v = next((v for v in self.rep._ready() if v.step == target), None)
        if v is None:  # never landed here whole: the leader gives it up after gather_timeout
            self.rep._give_up(target)
        return v

    def _on_holds(self, doc: dict) -> dict:
        """A peer's holds report (a server thread; the channel authenticated it). Kept for the
        leader's gather of that version, a few versions at most."""
        try:
            key = (int(doc["step"]), str(doc["attempt"]))
            node = str(doc["node"])
        except (KeyError, TypeError, ValueError):
            return {"accepted": False, "committed": self.rep._shown()}
        with self.rep._cond:
            if key[0] > self.rep.done - 64:
                self._reports.setdefault(key, {})[node] = doc
                while len(self._reports) > 16:
                    del self._reports[min(self._reports)]
                self.rep._cond.notify_all()
        return {"accepted": True, "committed": self.rep._shown()}

    def _gather(self, v: LocalVersion, doc: dict, world: int,
                own: dict[int, dict]) -> tuple[dict[str, list[str]] | None, dict[int, dict]]:
        """Wait for every rank's holds of ``v`` (ours, ``doc``, and the peers' reports); the
        merged ``{rank: [nodes]}`` and the rank manifests (``own``: this node's, parsed; the
        reported ones parsed here), or None when some rank's holds did not come within
        ``gather_timeout`` (the version is then not committed)."""
        key = (v.step, v.attempt)
        deadline = time.monotonic() + self.rep.opts.gather_timeout.total_seconds()
        with self.rep._cond:
            group = self.rep.group
            self._reports.setdefault(key, {})[self.rep.node] = doc
            while True:
                got = dict(self._reports.get(key, {}))
                merged = merge_holds(got.values(), v.attempt, world)
                missing = [r for r in range(world) if str(r) not in merged]
                left = deadline - time.monotonic()
                # A new worker group (a node lost, its holds never coming): the old group's
                # version is dropped now, not after gather_timeout. Waiting it out held the
                # new group's commits back 10 s while its durable versions went on
                # (tests/integration/test_job_launch.py: a replacement node then restored from durable).
                if not missing or left <= 0 or self.rep._stop or self.rep.group != group:
                    break
                self.rep._cond.wait(left)
            for k in [k for k in self._reports if k[0] <= v.step]:
                del self._reports[k]
            if missing and self.rep.group != group:
                return None, {}
        if missing:
            self.rep._emit("upload_error", step=v.step, phase="commit", error=(
                f"holds of ranks {missing[:8]}{'...' if len(missing) > 8 else ''} were not reported within "
                f"{self.rep.opts.gather_timeout.total_seconds():.0f} s; step {v.step} is not committed"))
            return None, {}
        manifests: dict[int, dict] = dict(own)
        for d in got.values():
            for r, text in (d.get("manifests") or {}).items():
                try:
                    if int(r) not in manifests:
                        manifests[int(r)] = json.loads(text)
                except (TypeError, ValueError):  # the tiling check reads it from a holder instead
                    pass
        return merged, manifests
