"""overhead: steady-state step time with everything on vs everything off (issues 5, 7).

Why: snapshots every step are only free if the training loop does not slow
down. Same config (the shrunk demo model, 2 workers, ``resilient launch``),
jobs alternating:

- off: ``snapshot.every=0``, ``snapshot.durable_every=0``;
- on: ``snapshot.every=1`` into the node's RAM store, ``durable_every=10``
  to file://, and SDC checks (``sdc.enable=true``);
- sdc: SDC checks only, to judge issue 7's own goal (checks default to on, so
  "off" sets ``sdc.enable=false`` explicitly).

Step time = median gap between rank 0's consecutive ``step`` events after a
warm-up (the capture runs after the step event, so it is inside the gap).
Spares are off (``launch.spares=0``) in both, so no background imports compete.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import Job, drop_dir, fig, goal, launch_cmd, ratio, row, shown, step_gaps, tiny_sets


def sdc_available() -> bool:
    from resilient.config import Config

    return "sdc" in {f for f in Config.__dataclass_fields__}


def judge(v: float | None, per_run: dict[str, list[float]], limit: float) -> tuple[bool | None, str]:
    """Met only when ratio + run-to-run noise is within the goal, not met when the ratio exceeds
    the goal by more than the noise; otherwise None ("not judged"), the noise stated: on this
    shared host a load swing between two runs can be far larger than 2%."""
    if v is None:
        return None, "no data"
    spreads = [(max(x) - min(x)) / statistics.median(x) for x in per_run.values() if len(x) >= 2]
    if not spreads:
        return None, f"ratio {v} ({(v - 1) * 100:+.1f}%) from one run each: noise unknown, not judged"
    noise = max(spreads)
    over = f"{(v - 1) * 100:+.1f}% (run-to-run noise {noise * 100:.0f}%)"
    if v - 1 > limit + noise:
        return False, f"{over}: over the {limit * 100:g}% goal by more than the noise"
    if v - 1 + noise <= limit:
        return True, over
    return None, f"{over}: the noise is larger than the {limit * 100:g}% goal, not judged"


def run(quick: bool) -> dict:
    steps, rounds = (30, 2) if quick else (120, 3)
    off = {"snapshot.every": 0, "snapshot.durable_every": 0}
    on = {"snapshot.every": 1, "snapshot.durable_every": 10}
    cases = {"off": off, "on": on}
    sdc = sdc_available()
    if sdc:  # SDC checks default to on: switch them off explicitly in "off"
        off["sdc.enable"], on["sdc.enable"] = False, True
        cases["sdc"] = {**off, "sdc.enable": True}
    root = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    per_run: dict[str, list[float]] = {k: [] for k in cases}
    gaps: dict[str, list[float]] = {k: [] for k in cases}
    cmds = {}
    try:
        for i in range(rounds):
            for name, extra in cases.items():
                run_dir = root / f"{name}-{i}"
                with Job(launch_cmd(run_dir, tiny_sets(steps, **{"launch.spares": 0, **extra})), run_dir) as job:
                    cmds[name] = shown(job.cmd)
                    rc = job.proc.wait(1200)
                    if rc != 0:
                        raise RuntimeError(f"{name} run failed ({rc}):\n{job.tail()}")
                g = step_gaps(run_dir, skip=10)
                gaps[name] += g
                per_run[name].append(statistics.median(g))
    finally:
        drop_dir(root)
    figures = {"off": fig(per_run["off"], "s", "step, everything off (median per run)"),
               "on": fig(per_run["on"], "s", "step, snapshots every step" + (" + SDC" if sdc else "")),
               "off_all_gaps": fig(gaps["off"], "s", "all step gaps, off"),
               "on_all_gaps": fig(gaps["on"], "s", "all step gaps, on")}
    r = ratio(figures["on_all_gaps"], figures["off_all_gaps"], "step time on / off (median of all gaps)")
    ratios = {"on_over_off": r, "on_over_off_runs": ratio(figures["on"], figures["off"], "step time on / off (median of per-run medians)")}
    if sdc:
        figures["sdc"] = fig(per_run["sdc"], "s", "step, SDC checks only (median per run)")
        figures["sdc_all_gaps"] = fig(gaps["sdc"], "s", "all step gaps, SDC only")
        ratios["sdc_over_off"] = ratio(figures["sdc_all_gaps"], figures["off_all_gaps"], "step time SDC only / off (median of all gaps)")
    v = r["value"]
    goals = [goal("per-step snapshot overhead ≤ 2% (issue 5)", *judge(v, {k: per_run[k] for k in ("off", "on")}, 0.02))]
    if sdc:
        goals.append(goal("SDC check overhead < 1% (issue 7)",
                          *judge(ratios["sdc_over_off"]["value"], {k: per_run[k] for k in ("off", "sdc")}, 0.01)))
    else:
        goals.append(goal("SDC check overhead < 1% (issue 7)", None, "pending: no [sdc] config section yet"))
    notes = [f"{rounds} round(s) alternating {'/'.join(cases)}, {steps} steps each, first 10 gaps dropped; 2 workers, "
             "spares off; tiny demo model (a ~5 MB state, steps of ~0.1-1 s on this loaded machine).",
             "The noise between runs on this shared 2-core machine is larger than the 2% goal: see the spread.",
             "Replication to a peer node (issue 5's 'with replication') needs 2 nodes: not in this row.",
             "Commands (RUN = a temp dir): " + "; ".join(f"{k}: `{c}`" for k, c in cmds.items())]
    return row("Steady-state step overhead, everything on vs off", figures, ratios, goals, notes)
