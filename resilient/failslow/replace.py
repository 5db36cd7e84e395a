"""The ranks' end of the fail-slow ``replace`` policy: is there anyone to take this node's seat?

At a device or host verdict every rank reads its agent's seats file
(:data:`~resilient.contract.SEATS_ENV`: whether a warm spare waits or the job may shrink),
and one all-reduce agrees on it and on the re-form's cost (:func:`agree`); the slow
node's ranks tell their agent before their final save (:func:`note_leaving`). The
agent's end, which writes the file and hands the seat over, is :mod:`resilient.agent.seats`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from resilient.contract import LEAVING, SEAT_CODES, SEATS_ENV

__all__ = ["agree", "local_seat", "note_leaving"]


def local_seat(path: str | None = None) -> str | None:
    """This rank's agent's answer (None: no agent, or it has not written one yet)."""
    path = path or os.environ.get(SEATS_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            seat = json.load(f).get("seat")
    except (OSError, ValueError, AttributeError):
        return None
    return seat if seat in SEAT_CODES else None


def agree(group: Any, reform_seconds: float) -> tuple[str | None, float]:
    """Collective over ``group``: the best seat answer of every rank's agent, and the longest
    re-form any rank measured (each measures its own start: the ranks must weigh the same
    numbers, or some would act and the others not)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([float(SEAT_CODES.index(local_seat())), reform_seconds], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return SEAT_CODES[int(mine[0].item())], float(mine[1].item())


def note_leaving(replacing: dict) -> None:
    """A rank of the slow node, at the decision: tell its agent before the final save (the
    agent must not restart these workers meanwhile, e.g. for the spare now waiting)."""
    path = os.environ.get(SEATS_ENV)
    if path:
        tmp = Path(path + LEAVING + f".{os.getpid()}")
        tmp.write_text(json.dumps(replacing))
        os.replace(tmp, path + LEAVING)
