"""What a slow device, host or link does to a step's timing matrix.

For the detector's tests and ``bench/failslow.py``: clean matrices, drawn
(:func:`clean_rows`) or measured on a real job, get a slowdown spliced in
(:func:`slow_down`) the way a synchronous step would show it: a slow rank's
own time grows and everyone else waits for it; a slow link stretches the time
every rank spends in its collectives.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

from resilient.failslow.detector import QUEUED, WAIT, WALL

Rows = list[list[float]]


def clean_rows(rng: random.Random, world: int, *, step: float = 0.03, sigma: float = 0.06,
               spike: float = 0.005, transfer: float = 0.002, imbalance: Sequence[float] = ()) -> Rows:
    """One healthy step: each rank's own time ``step`` x lognormal(``sigma``) (x ``imbalance[r]``:
    a pipeline's unequal stages), a one-step hiccup of x1.3-3 with probability ``spike``; every
    rank then waits for the slowest and for the ``transfer``."""
    own = []
    for r in range(world):
        t = step * math.exp(rng.gauss(0.0, sigma)) * (imbalance[r] if r < len(imbalance) else 1.0)
        if rng.random() < spike:
            t *= rng.uniform(1.3, 3.0)
        own.append(t)
    wall = max(own) + transfer * math.exp(rng.gauss(0.0, sigma))
    return [[o, wall - o, 0.0, 0.0, wall, 0.0] for o in own]


def slow_down(rows: Sequence[Sequence[float]], cause: str, factor: float, *, ranks: Sequence[int] = ()) -> Rows:
    """``rows`` with ``ranks`` (device, host) or the links (link) made ``factor`` times slower."""
    out = [list(r) for r in rows]
    if cause == "link":
        transfer = min(r[WAIT] for r in rows)
        extra = transfer * (factor - 1.0)
        for r in out:
            r[WAIT] += extra
            r[WALL] += extra
        return out
    own = {i: rows[i][WALL] - rows[i][WAIT] - rows[i][QUEUED] for i in ranks}
    extra = {i: own[i] * (factor - 1.0) for i in ranks}
    longest = max(rows[i][WALL] - rows[i][WAIT] + extra[i] for i in ranks)
    # the step now ends when the slowest of the slowed ranks is done and the bytes moved
    grow = max(0.0, longest + min(r[WAIT] for r in rows) - max(r[WALL] for r in rows))
    for i, r in enumerate(out):
        busy = r[WALL] - r[WAIT] + extra.get(i, 0.0)
        r[0] += extra.get(i, 0.0)
        r[WALL] = max(r[WALL] + grow, busy)
        r[WAIT] = r[WALL] - busy
    return out
