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
    key = epoch_key(run_id)
    found = read_records(client, f"/resilient/{run_id}/commit/", COMMIT, secret, events, "commit record")
    here = found.pop(key.rsplit("/", 1)[-1], None)
    others, _ = epoch_ledger(None, secret, copies, events).read(key) if copies else (None, {})
    epoch = Epoch.from_doc(max((d for d in (here, others) if d is not None),
                               key=lambda d: (int(d.get("gen", 0)) if isinstance(d.get("gen"), int) else 0,
                                              rollback_order(d)), default=None))
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
    return out
