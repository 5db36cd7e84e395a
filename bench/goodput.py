"""goodput: the effective training time ratio of a chaos soak, beside a simulation of
torchrun + periodic DCP checkpoints under the same faults (issue 27).

    python bench/goodput.py --soak RUN_DIR            # a soak's output (its faulted/ dir, or above)
    python bench/goodput.py --run-soak 300            # run a short soak first (--budget 300)

**Measured** (ours): the soak's merged event log, split by
:mod:`resilient.observe.goodput` (productive, redone, snapshot stalls,
start-up, detection, recovery, other); the ratio = kept step time / wall time;
the fault rate = faults injected / wall hours.

**Simulated** (torchrun + DCP every ``I`` steps), from this repository's own
measured rows (bench/results/*.json, shown in bench/RESULTS.md), never run:

* every incident of the soak (a fault that stopped training) costs torchrun
  the same detection time as ours (favourable to torchrun: it has no
  heartbeat, a hang waits for the collective timeout), plus its measured
  restart: ``recovery`` row, ``torchrun`` (kill -9 of a worker → first step,
  torchrun restart + durable restore) for worker-level causes, and the
  ``recovery_node`` row's ``torchrun_replace`` (a node lost and replaced) for
  node-level ones; plus ``I/2`` steps redone (a fault lands uniformly inside a
  checkpoint interval; the ``recovery`` row measured 2.5 steps at ``I = 5``);
* every ``I`` kept steps one DCP save blocks training for our measured
  snapshot stall × the ``ownscript`` row's ratio ``torchrun_dcp_blocked /
  resilient_blocked`` (DCP ``async_save`` against our capture, one script);
* faults that did not stop our training (slow links, etcd faults, storage
  errors) cost both the same: nothing is added for them;
* productive time, start-up and the rest are ours unchanged.

A steady-state projection at N faults/hour (start-up left out, as in a long
job) uses the mean cost per injected fault of each side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import REPO, fig, goal, row  # noqa: E402

from resilient.events import merge_events  # noqa: E402
from resilient.observe.goodput import Goodput, goodput  # noqa: E402

RESULTS = BENCH / "results"
INTERVALS = (5, 25, 100)            # DCP checkpoint intervals simulated (steps)
PROJECT_RATES = (1, 10)             # faults per hour for the steady-state projection
NODE_CAUSES = frozenset({"kill-node", "preemption", "partition", "link-cut", "scale-down", "scale-up",
                         "node_lost", "round_lost", "relaunch"})


def soak_logs(run_dir: Path) -> list[str]:
    """Every events.jsonl of the soak (its faulted/ job and the harness), not the reference's."""
    faulted = run_dir / "faulted" if (run_dir / "faulted").is_dir() else run_dir
    logs = sorted(str(p) for p in faulted.rglob("events.jsonl"))
    if not logs:
        raise SystemExit(f"{run_dir}: no events.jsonl; give a chaos soak's output dir (--soak) or --run-soak SECONDS")
    return logs


def measured_inputs() -> dict[str, float]:
    """The anchors' measured figures the simulation takes, from bench/results/*.json."""
    def median(name: str, key: str) -> float:
        path = RESULTS / f"{name}.json"
        try:
            return float(json.loads(path.read_text())["figures"][key]["median"])
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}: no figure {key!r} ({e}); run `python bench/run.py {name}` first") from None

    return {"torchrun_worker_recovery_s": median("recovery", "torchrun"),
            "torchrun_node_recovery_s": median("recovery_node", "torchrun_replace"),
            "dcp_blocked_ms": median("ownscript", "torchrun_dcp_blocked"),
            "resilient_blocked_ms": median("ownscript", "resilient_blocked")}


def simulate(g: Goodput, inputs: dict[str, float], interval: int) -> dict:
    """torchrun + DCP every ``interval`` steps under the soak's incidents (module docstring)."""
    step_s = g.productive / g.steps_kept if g.steps_kept else 0.0
    our_stall = g.snapshot_stall / max(1, g.stalls)  # per snapshot
    dcp_block = our_stall * inputs["dcp_blocked_ms"] / inputs["resilient_blocked_ms"]
    cost = 0.0
    for inc in g.incidents:
        restart = inputs["torchrun_node_recovery_s" if inc.cause in NODE_CAUSES else "torchrun_worker_recovery_s"]
        cost += inc.detection_s + restart + interval / 2 * step_s
    stalls = g.steps_kept / interval * dcp_block
    wall = g.productive + g.startup + g.other + stalls + cost
    return {"interval": interval, "wall_s": wall, "ratio": g.productive / wall if wall else None,
            "incident_cost_s": cost, "stall_s": stalls, "dcp_block_s": dcp_block, "step_s": step_s}


def project(per_step_s: float, stall_per_step_s: float, cost_per_fault_s: float, rate: float) -> float:
    """Steady-state ratio at ``rate`` faults/hour: the stall share, then the faults' share of the rest."""
    return per_step_s / (per_step_s + stall_per_step_s) * max(0.0, 1 - rate * cost_per_fault_s / 3600)


def analyse(run_dir: Path) -> dict:
    g = goodput(merge_events(soak_logs(run_dir)))
    if not g.steps_kept:
        raise SystemExit(f"{run_dir}: the soak made no step; nothing to measure")
    inputs = measured_inputs()
    injected = sum(c.injected for c in g.by_cause.values())
    hours = g.wall / 3600
    sims = [simulate(g, inputs, i) for i in INTERVALS]
    step_s = g.productive / g.steps_kept
    ours_cost = (g.detection + g.recovery + g.redone) / max(1, injected)
    figures = {"ratio_resilient": fig([100 * g.ratio], "%", "resilient: effective training time ratio (measured)", 2),
               "faults_per_hour": fig([injected / hours], "faults/h", f"faults injected per hour ({injected} in "
                                      f"{g.wall:.0f} s)", 1),
               "incidents_per_hour": fig([len(g.incidents) / hours], "/h", "incidents (training stopped) per hour", 1)}
    for part, v in g.parts().items():
        figures[f"part_{part}"] = fig([100 * v / g.wall], "%", f"resilient: {part.replace('_', ' ')} share of wall", 2)
    for s in sims:
        figures[f"ratio_torchrun_dcp_{s['interval']}"] = fig(
            [100 * s["ratio"]], "%", f"torchrun + DCP every {s['interval']} steps: ratio (simulated)", 2)
    ratios = {f"torchrun_{s['interval']}": {"value": round(g.ratio / s["ratio"], 3), "better": "higher",
                                            "label": f"goodput resilient / torchrun + DCP every {s['interval']} steps "
                                                     f"(simulated), {injected / hours:.0f} faults/h"} for s in sims}
    projections = []
    for rate in PROJECT_RATES:
        ours = project(step_s, g.snapshot_stall / g.steps_kept, ours_cost, rate)
        for s in sims:
            theirs = project(step_s, s["stall_s"] / g.steps_kept, s["incident_cost_s"] / max(1, injected), rate)
            projections.append({"faults_per_hour": rate, "interval": s["interval"], "resilient": ours, "torchrun_dcp": theirs})
        figures[f"projected_{rate}_per_hour"] = fig([100 * ours], "%", f"resilient at {rate} fault(s)/h (projection)", 2)
    notes = [
        f"Measured: {injected} faults in {g.wall:.0f} s ({injected / hours:.0f}/h), {len(g.incidents)} stopped training; "
        f"{g.steps_kept} steps kept, {g.steps_redone} redone. Split: " + ", ".join(
            f"{p.replace('_', ' ')} {100 * v / g.wall:.1f}%" for p, v in g.parts().items()) + ".",
        "Cost per fault kind (detection + recovery + redone, s): " + ", ".join(
            f"{k} {c.cost_s:.1f} ({c.incidents} stops)" for k, c in sorted(g.by_cause.items()) if c.incidents) + ".",
        "torchrun + DCP is SIMULATED, not run: per incident our detection time + torchrun's measured restart "
        f"({inputs['torchrun_worker_recovery_s']:.2f} s worker, `recovery` row; {inputs['torchrun_node_recovery_s']:.2f} s "
        "node, `recovery_node` row, replace) + I/2 steps redone; one DCP save per I kept steps blocking "
        f"{inputs['dcp_blocked_ms'] / inputs['resilient_blocked_ms']:.2f}x our measured stall (`ownscript` row). "
        "Faults that did not stop training cost both nothing. See bench/goodput.py.",
        "Projections at N faults/h: steady state (no start-up), mean cost per injected fault of each side: " + "; ".join(
            f"{p['faults_per_hour']}/h, I={p['interval']}: resilient {100 * p['resilient']:.1f}% vs torchrun+DCP "
            f"{100 * p['torchrun_dcp']:.1f}%" for p in projections) + ".",
    ]
    stopped = g.detection + g.recovery + g.redone
    top = sorted(((c.cost_s, k, c.incidents) for k, c in g.by_cause.items() if c.incidents), reverse=True)[:2]
    if top and stopped > 0:
        notes.append("Largest costs: " + ", ".join(f"{k} {cost:.1f} s ({n} stops)" for cost, k, n in top)
                     + f": {100 * sum(t[0] for t in top) / stopped:.0f}% of the {stopped:.0f} s training stood still.")
    best = max(sims, key=lambda s: s["ratio"])
    goals = [goal("goodput under the soak's faults at least torchrun + periodic DCP's (simulated, best interval)",
                  g.ratio >= best["ratio"], f"{100 * g.ratio:.1f}% vs {100 * best['ratio']:.1f}% (I={best['interval']})")]
    out = row("Goodput under chaos: effective training time ratio vs torchrun + DCP (simulated)", figures, ratios,
              goals, notes)
    out.update(soak=str(run_dir), inputs=inputs, goodput=g.to_dict(), simulated=sims, projections=projections)
    return out


def run_soak(budget: int, out: Path) -> Path:
    cmd = [sys.executable, "-m", "resilient.cli", "chaos", "run", "chaos/scenarios/soak.toml", "--out", str(out),
           "--budget", str(budget)]
    print("running:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)  # a failed property still leaves a timeline to measure
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--soak", type=Path, help="a chaos soak's output dir (resilient chaos run ... --out DIR)")
    src.add_argument("--run-soak", type=int, metavar="SECONDS", help="run a soak with this budget first")
    ap.add_argument("--out", type=Path, default=None, help="where --run-soak writes (default runs/chaos/goodput-soak)")
    ap.add_argument("--write", action="store_true", help="write bench/results/goodput.json (RESULTS.md's source)")
    ap.add_argument("--note", action="append", default=[], help="a note for the row (what the numbers mean)")
    args = ap.parse_args(argv)
    t0, load0 = time.time(), os.getloadavg()
    soak = args.soak or run_soak(args.run_soak, args.out or REPO / "runs" / "chaos" / "goodput-soak")
    res = analyse(soak)
    res["notes"] += args.note
    budget = json.loads((soak / "faulted" / "results.json").read_text()).get("scenario", {}).get("budget_seconds") \
        if (soak / "faulted" / "results.json").exists() else None
    res.update(name="goodput", quick=False, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               command=f"resilient chaos run chaos/scenarios/soak.toml --out SOAK{f' --budget {budget:g}' if budget else ''}"
                       " && python bench/goodput.py --soak SOAK --write",
               host=f"{platform.node()}, {os.cpu_count()} cores",
               wall_s=round(res["goodput"]["wall_s"] + (time.time() - t0 if args.run_soak else 0), 1),
               load=" → ".join("/".join(f"{x:.1f}" for x in la) for la in (load0, os.getloadavg())))
    for n in res["notes"]:
        print("-", n)
    for rt in res["ratios"].values():
        print(f"  {rt['label']}: {rt['value']}x")
    if args.write:
        (RESULTS / "goodput.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {RESULTS / 'goodput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
