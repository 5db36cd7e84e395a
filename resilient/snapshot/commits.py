"""Where the memory tiers' commit records live in etcd, and how they are read back.

Apart from the replicator (:mod:`.memcommit`, which writes them in the agent) because the
workers' restore (:mod:`.tiers`) and ``resilient status`` read them too, and need none of
the replicator's machinery. Every record carries a MAC under the job secret
(:mod:`resilient.secret`); one that fails is reported (``auth_failure``) and left out.
"""

from __future__ import annotations

from typing import Any, Iterable

from resilient.ledger import Copy
from resilient.secret import COMMIT, JobSecret, read_records, report_unauthentic
from resilient.snapshot.epoch import Epoch, rollback_order, epoch_key, epoch_ledger, made_in


def commit_prefix(run_id: str, tier: str) -> str:
    return f"/resilient/{run_id}/commit/{tier}/"


def commit_key(run_id: str, tier: str, step: int) -> str:
    return f"{commit_prefix(run_id, tier)}{step:012d}"


def holds_prefix(run_id: str, step: int) -> str:
    return f"/resilient/{run_id}/mem/holds/{step:012d}/"


def read_commits(client, run_id: str, secret: JobSecret | bytes, events: Any = None,
                 copies: Iterable[Copy] = ()) -> list[dict]:
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
                       copies: Iterable[Copy] = ()) -> tuple[list[dict], Epoch]:
    """:func:`read_commits`, and the run's epoch it judged them by (what a restore also judges
    the versions of the other tiers by: :func:`resilient.snapshot.auth.admit`)."""
    key = epoch_key(run_id)
    found = read_records(client, f"/resilient/{run_id}/commit/", COMMIT, secret, events, "commit record")
    epoch = run_epoch(found.pop(key.rsplit("/", 1)[-1], None), secret, run_id, copies, events)
    out = []
    for suffix, rec in found.items():
        try:
            rec["step"] = int(rec["step"])
        except (KeyError, TypeError, ValueError):
            continue
        if not epoch.admits(rec["step"], made_in(rec)):
            report_unauthentic(events, "abandoned commit record", f"/resilient/{run_id}/commit/{suffix}",
                               f"step {rec['step']} of epoch {made_in(rec)} was abandoned by a rollback to step "
                               f"{epoch.cap(made_in(rec))} (the run is in epoch {epoch.gen}): an old record put back")
            continue
        out.append(rec)
    return out, epoch
