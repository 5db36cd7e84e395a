"""lostwork: steps redone per failure vs the durable snapshot interval (issues 3, 9).

Why: with only the durable tier, a failure costs on average half an interval
of recomputed steps; the per-step RAM tier is what brings that to ≤ 1. One
``resilient launch`` job per interval with ``snapshot.memory=false`` (restore
from durable) and ``durable_every`` ∈ {1, 5, 10}; plus the RAM tier
(memory on, every step) for reference. Kills land at random points.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import Job, drop_dir, fig, goal, kill_series, launch_cmd, row, shown, tiny_sets


def run(quick: bool) -> dict:
    kills = 1 if quick else 4
    intervals = [] if quick else [1, 5, 10]  # quick: only the RAM tier, whose goal is judged
    root = Path(tempfile.mkdtemp(prefix="bench-lostwork-"))
    figures, cmds, tiers = {}, {}, {}
    try:
        cases = [(f"durable_every_{n}", {"snapshot.memory": False, "snapshot.durable_every": n}) for n in intervals]
        cases.append(("ram_every_step", {"snapshot.durable_every": 10}))
        for name, extra in cases:
            with Job(launch_cmd(root / name, tiny_sets(**{"snapshot.every": 1, **extra})), root / name) as job:
                cmds[name] = shown(job.cmd)
                # settle past one interval so a kill can land anywhere in it
                n = extra.get("snapshot.durable_every", 1)
                rs = kill_series(job, kills, spares=0, settle_steps=3, jitter_steps=n - 1)
            figures[name] = fig([r["lost_steps"] for r in rs], "steps",
                                name.replace("_", " ").replace("ram every step", "RAM tier, every step"), 1)
            tiers[name] = sorted({str(r["tier"]) for r in rs})
    finally:
        drop_dir(root)
    ratios = {k: {"value": f["median"], "unit": " steps", "better": "lower",
                  "label": f"steps redone per failure (median), {f['label']}"} for k, f in figures.items()}
    ram = figures["ram_every_step"]["max"]
    goals = [goal("at most one step lost per failure with per-step RAM snapshots (DESIGN)", ram is not None and ram <= 1,
                  f"max {ram} steps redone")]
    notes = (["Quick mode: the RAM tier only (durable intervals in full mode)."] if quick else []) + [
             f"{kills} kills per interval (kill -9 of local rank 1), one job each; lost = last step logged before "
             "the kill − the step restored.", f"restore tiers seen: {tiers}.",
             "Commands (RUN = a temp dir): " + "; ".join(f"{k}: `{v}`" for k, v in cmds.items())]
    return row("Lost work per failure vs snapshot interval", figures, ratios, goals, notes)
