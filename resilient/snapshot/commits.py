"""Where the memory tiers' commit records live in etcd, and how they are read back.

Apart from the replicator (:mod:`.memcommit`, which writes them in the agent) because the
workers' restore (:mod:`.tiers`) and ``resilient status`` read them too, and need none of
the replicator's machinery. Every record carries a MAC under the job secret
(:mod:`resilient.secret`); one that fails is reported (``auth_failure``) and left out.
"""

from __future__ import annotations

from typing import Any

from resilient.secret import COMMIT, JobSecret, read_records


def commit_prefix(run_id: str, tier: str) -> str:
    return f"/resilient/{run_id}/commit/{tier}/"


def commit_key(run_id: str, tier: str, step: int) -> str:
    return f"{commit_prefix(run_id, tier)}{step:012d}"


def holds_prefix(run_id: str, step: int) -> str:
    return f"/resilient/{run_id}/mem/holds/{step:012d}/"


def read_commits(client, run_id: str, secret: JobSecret | bytes, events: Any = None) -> list[dict]:
    """Every commit record of the run (both tiers) that authenticates, with a well-formed step."""
    out = []
    for rec in read_records(client, f"/resilient/{run_id}/commit/", COMMIT, secret, events, "commit record").values():
        try:
            rec["step"] = int(rec["step"])
        except (KeyError, TypeError, ValueError):
            continue
        out.append(rec)
    return out
