"""The memory tiers' commit through etcd: every node records its holds there.

Per version, each node records what it holds (``/resilient/<run>/mem/holds/<S>/<N>``,
MAC'd under the job secret) and reads every node's record of S back in the same
transaction; whoever sees every rank covered commits (create-only, so the nodes never
disagree). N + 1 etcd writes and N² bytes read per version (bench/scale.py): the protocol
of a replicator with no peer server, and ``snapshot.commit = "etcd"``. The default,
:mod:`.leadcommit`, costs one transaction per version.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from resilient.secret import COMMIT, HOLDS
from resilient.snapshot.api import CommitProtocol
from resilient.snapshot.commits import RECORD_TIERS, commit_prefix, holds_prefix, merge_holds
from resilient.snapshot.nodestore import LocalVersion

if TYPE_CHECKING:
    from resilient.snapshot.memcommit import Replicator


class EtcdCommit(CommitProtocol):
    """The etcd protocol for ``rep``'s node: no state of its own; it records and reads holds
    through the replicator's etcd client and commits through the replicator."""

    def __init__(self, rep: "Replicator"):
        self.rep = rep

    def commit(self, v: LocalVersion, world: int, holders: dict[int, list[str]], manifests: dict[int, bytes],
               parsed: dict[int, dict], tiers: dict[str, int]) -> None:
        t0 = time.monotonic()
        self.rep._commit(v, world, self.hold(v, holders, world), tiers, parsed)
        self.rep._costs["commit_us"] = round((time.monotonic() - t0) * 1e6)

    def hold(self, v: LocalVersion, holders: dict[int, list[str]], world: int) -> dict[str, list[str]]:
        """Record what this node holds and read every node's records of ``v`` (one txn):
        the merged ``{rank: [nodes]}`` of this version's attempt and world."""
        rep = self.rep
        doc = {"attempt": v.attempt, "world": world, "holders": {str(r): h for r, h in holders.items()}}
        prefix = holds_prefix(rep.run_id, v.step)
        kvs, newest = rep.client.put_and_get_prefix(
            prefix + rep.node, rep.secret.seal_record(HOLDS, prefix + rep.node, doc), prefix,
            newest_under=[commit_prefix(rep.run_id, t) for t in RECORD_TIERS])
        with rep._cond:  # the newest commits, whoever made them: retention must keep them
            for tier, kv in zip(RECORD_TIERS, newest):
                if kv is not None and rep._authentic(COMMIT, kv, "commit record") is not None:
                    rep.committed[tier] = max(rep.committed.get(tier, -1), int(kv.key[-12:]))
        docs = [got for got in (rep._authentic(HOLDS, kv, "holds record") for kv in kvs) if got is not None]
        return merge_holds(docs, v.attempt, world)
