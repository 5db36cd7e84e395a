"""The memory tiers' commit records: their format, where they live in etcd, how they are read back.

One module owns the record (:class:`CommitRecord`): the replicator (:mod:`.memcommit`, in the
agent) writes it, the workers' restore (:mod:`.tiers`) and ``resilient status`` read it, and
none of them spells its fields. Apart from the replicator because the readers need none of its
machinery. Every record carries a MAC under the job secret (:mod:`resilient.secret`); one that
fails is reported (``auth_failure``) and left out, and one that authenticates but is not a
well-formed record is left out too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from resilient.ledger import Copy
from resilient.secret import COMMIT, JobSecret, read_records, report_unauthentic
from resilient.snapshot.epoch import Epoch, abandon_after, rollback_order, epoch_key, epoch_ledger, made_in


# The two records of a version in node RAM (``/resilient/<run>/commit/<tier>/<step>``). LOCAL:
# every rank's files are in its own node's RAM (the local tier). REPLICATED: also in ``k`` other
# nodes' RAM, k as many as ``snapshot.replicas`` asks and the other live nodes allow; that is the
# peer tier when k > 0 (a node alone writes it with k = 0).
LOCAL, REPLICATED = "local", "replicated"
RECORD_TIERS = (LOCAL, REPLICATED)


@dataclass
class CommitRecord:
    """One commit of a version at a memory tier: JSON at :func:`commit_key`, sealed under the
    job secret, written once (create-only, fenced by the run's epoch)."""

    step: int
    attempt: str        # the version's attempt directory (``<group>-<seq>``): which write of the step
    world: int          # ranks in the version
    holders: dict[str, list[str]] = field(default_factory=dict)   # rank (a JSON key) -> nodes holding its files
    k: int = 0          # copies beyond the first: 0 is the local tier, more the peer tier
    time: float = math.inf   # when it was committed: an agent started after it holds an empty store
    epoch: int = 0      # the rollback epoch it was made in (:mod:`.epoch`; -1: not said well)

    @property
    def tier(self) -> str:
        """The tier it commits the version at, as events and ``resilient status`` name it."""
        return "peer" if self.k > 0 else LOCAL

    def to_doc(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "world": self.world, "k": self.k,
                "holders": self.holders, "time": self.time, "epoch": self.epoch}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CommitRecord | None:
        """The record of an authenticated document, or None when it is not a well-formed one."""
        try:
            step, world, k = int(doc["step"]), int(doc["world"]), int(doc.get("k", 0))
            attempt, holders = doc["attempt"], doc["holders"]
            when = float(doc.get("time", math.inf))
        except (KeyError, TypeError, ValueError):
            return None
        if not isinstance(attempt, str) or not isinstance(holders, dict) or not all(
                isinstance(h, list) and all(isinstance(n, str) for n in h) for h in holders.values()):
            return None
        return cls(step, attempt, world, {str(r): list(h) for r, h in holders.items()}, k, when, made_in(doc))

    def add_holders(self, holders: Mapping[str, list[str]]) -> None:
        """The same version held elsewhere too (its other tier's record, a kept tree): the union."""
        union_holders(self.holders, holders)


def union_holders(into: dict[str, list[str]], more: Mapping[str, list[str]]) -> None:
    """``{rank: [nodes]}``: add ``more``'s nodes to ``into``, each once, in the order first seen."""
    for r, h in more.items():
        have = into.setdefault(r, [])
        have += [n for n in h if n not in have]


def merge_holds(docs: Iterable[Mapping[str, Any]], attempt: str, world: int) -> dict[str, list[str]]:
    """``{rank: [nodes]}`` over the holds documents of ``attempt`` and ``world`` (each node's
    ``{"attempt", "world", "holders": {rank: [nodes]}}``, from etcd or reported to a leader)."""
    merged: dict[str, list[str]] = {}
    for got in docs:
        if got.get("attempt") != attempt or got.get("world") != world:
            continue
        union_holders(merged, got.get("holders") or {})
    return merged


def commit_prefix(run_id: str, tier: str) -> str:
    """Where ``tier``'s records (one of :data:`RECORD_TIERS`) of a run lie; another name is a
    ValueError (a misspelt tier would read nothing and write where no one looks)."""
    if tier not in RECORD_TIERS:
        raise ValueError(f"commit records have the tiers {RECORD_TIERS}, not {tier!r}")
    return f"/resilient/{run_id}/commit/{tier}/"


def commit_key(run_id: str, tier: str, step: int) -> str:
    return f"{commit_prefix(run_id, tier)}{step:012d}"


def holds_prefix(run_id: str, step: int) -> str:
    return f"/resilient/{run_id}/mem/holds/{step:012d}/"


def abandon_commits_after(client, run_id: str, secret: JobSecret | bytes, step: int, copies: Iterable[Copy] = (),
                          events: Any = None, always: bool = True) -> Epoch | None:
    """A rollback to ``step``: the run's next epoch, then both tiers' records of later steps
    deleted (:func:`resilient.snapshot.epoch.abandon_after`). The new epoch, or None."""
    return abandon_after(client, run_id, secret, step, [commit_prefix(run_id, t) for t in RECORD_TIERS],
                         copies, events, always)


def read_commits(client, run_id: str, secret: JobSecret | bytes, events: Any = None,
                 copies: Iterable[Copy] = ()) -> list[CommitRecord]:
    """Every commit record of the run (both tiers) that authenticates, has a well-formed step
    and is not abandoned by a rollback (the epoch: etcd's copy, read with the records, and
    those of ``copies``, the run's ledger beside etcd)."""
    return read_commits_epoch(client, run_id, secret, events, copies)[0]


def run_epoch(here: dict | None, secret: JobSecret | bytes, run_id: str, copies: Iterable[Copy] = (),
              events: Any = None) -> Epoch:
    """The run's epoch: the newest of etcd's authentic copy ``here`` (None: absent or unread)
    and the copies of the run's ledger beside etcd (``copies``)."""
    copies = list(copies)
    others, _ = epoch_ledger(None, secret, copies, events).read(epoch_key(run_id)) if copies else (None, {})
    return Epoch.from_doc(max((d for d in (here, others) if d is not None),
                              key=lambda d: (int(d.get("gen", 0)) if isinstance(d.get("gen"), int) else 0,
                                             rollback_order(d)), default=None))


def read_run_epoch(client, run_id: str, secret: JobSecret | bytes, copies: Iterable[Copy] = (),
                   events: Any = None) -> Epoch:
    """The run's epoch alone (``client`` None, or etcd unreachable: from ``copies`` only)."""
    here = None
    if client is not None:
        try:
            here = read_records(client, epoch_key(run_id), COMMIT, secret, events, "commit epoch record").get("")
        except Exception:   # etcd down: the ledger's other copies still say it
            here = None
    return run_epoch(here, secret, run_id, copies, events)


def read_commits_epoch(client, run_id: str, secret: JobSecret | bytes, events: Any = None,
                       copies: Iterable[Copy] = ()) -> tuple[list[CommitRecord], Epoch]:
    """:func:`read_commits`, and the run's epoch it judged them by (what a restore also judges
    the versions of the other tiers by: :func:`resilient.snapshot.auth.admit`)."""
    key = epoch_key(run_id)
    found = read_records(client, f"/resilient/{run_id}/commit/", COMMIT, secret, events, "commit record")
    epoch = run_epoch(found.pop(key.rsplit("/", 1)[-1], None), secret, run_id, copies, events)
    out = []
    for suffix, doc in found.items():
        rec = CommitRecord.from_doc(doc)
        if rec is None:
            continue
        if not epoch.admits(rec.step, rec.epoch):
            report_unauthentic(events, "abandoned commit record", f"/resilient/{run_id}/commit/{suffix}",
                               f"step {rec.step} of epoch {rec.epoch} was abandoned by a rollback to step "
                               f"{epoch.cap(rec.epoch)} (the run is in epoch {epoch.gen}): an old record put back")
            continue
        out.append(rec)
    return out, epoch
