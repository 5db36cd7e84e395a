"""Fail-slow policies side by side (issue 26): throughput before, during and after a slow
rank, under ``failslow.policy = "report"`` and ``"replace"``.

The chaos harness's ``slow-rank-replace`` scenario (2 nodes x 1 worker + 1 warm spare;
rank 1 slowed 3x (from step 60 there, 100 here) by a SIGSTOP/SIGCONT duty cycle, chaos/slow.py) is run
twice with the same seed and layout, once per policy, through ``resilient_chaos.runner``
(no fault-free reference: only throughput is read, so ``training.reference = false`` and
``final_state = "skip"``). The slowdown lasts a fixed time, so ``report`` has an "after"
too. From each run's merged event log (rank 0's ``step`` events; ``fault_injected``,
``fault_cleared``, ``straggler``, ``failslow_replace``, ``failslow_mark``):

- throughput per step = tokens per step / wall gap between rank 0's consecutive steps of
  one incarnation (snapshots and the fail-slow boundary included, the re-form left out);
- three windows, median over their steps: **before** the injection (after a warm-up);
  **during**: report, the injection to the slowdown's end; replace, the injection to the
  hand-over; **after**: report, after the slowdown ends; replace, after the re-form;
- **wall time lost** against the healthy rate (the before window's median step) over the
  fault's span (report: the injection to the slowdown's end; replace: to the first step
  after the re-form), and for replace the **re-form pause** (the last step before the
  hand-over to the first step after it).

    python bench/run.py failslow_policy            # ~3 min on 2 shared cores
    python bench/run.py failslow_policy --quick    # ~1.5-2 min
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from common import BENCH, REPO, fig, goal, load_note, row
from resilient.observe.plots import pyplot

SCENARIO = REPO / "chaos" / "scenarios" / "slow-rank-replace.toml"
POLICIES = ("report", "replace")
WARMUP_STEPS = 5   # the first steps of a run pay for allocations and the first snapshots
# The injection comes at step 100, not the scenario's 60 (which was 40): the harness starts the spare's agent
# once the first round formed, and on a loaded 2-core host it had not registered by step ~46
# in one quick run (verdict seat "none": nobody to hand the seat to, so nothing replaced).
INJECT_STEP = 100
SIZES = {True: {"steps": 170, "slow_s": 8.0, "budget_s": 300.0},
         False: {"steps": 380, "slow_s": 20.0, "budget_s": 600.0}}
RESTORED = 0.9   # "replace restores throughput": after / before at least this


# ------------------------------------------------------------------ scenario
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)   # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {type(v).__name__}")


def to_toml(table: dict) -> str:
    """A scenario table as TOML (scalars, [tables], [[arrays of tables]]; no writer in the stdlib)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, (dict, list))]
    for k, v in table.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list):
            for item in v:
                lines += ["", f"[[{k}]]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


def scenario_for(policy: str, steps: int, slow_s: float, budget_s: float) -> dict:
    """The shipped scenario with this policy, length and slowdown, and no reference run."""
    from resilient.configbase import read_toml

    table = read_toml(SCENARIO, "scenario")
    table["name"] = f"failslow-policy-{policy}"
    table["description"] = f"rank 1 at 3x from step {INJECT_STEP} for {slow_s:g} s under failslow.policy = {policy} (bench)"
    table["budget_seconds"] = budget_s
    set_here = {"failslow.policy": json.dumps(policy), "train.steps": str(steps)}
    table["training"]["overrides"] = [o for o in table["training"]["overrides"] if o.split("=", 1)[0] not in set_here] \
        + [f"{k}={v}" for k, v in set_here.items()]
    table["training"]["reference"] = False
    table["properties"]["final_state"] = "skip"
    (fault,) = table["faults"]
    fault["params"]["seconds"] = slow_s
    fault["at_step"] = INJECT_STEP
    return table


def tokens_per_step(table: dict) -> int:
    sets = dict(o.split("=", 1) for o in table["training"]["overrides"])
    return int(sets["train.global_batch"]) * int(sets["train.seq_len"])


# ------------------------------------------------------------------ analysis
def _first(timeline: list[dict], kind: str, after: float = 0.0) -> dict | None:
    return next((e for e in timeline if e["event"] == kind and e["time"] >= after), None)


def analyse(run_dir: Path, tokens: int) -> dict:
    """Per-step throughput and the moments of one run, from its merged event log."""
    from resilient_chaos.timeline import load_timeline

    tl = load_timeline(run_dir)
    steps = sorted((e for e in tl if e["event"] == "step" and e["rank"] == 0), key=lambda e: e["time"])
    starts = [e["time"] for e in tl if e["event"] == "run_start" and e["rank"] == 0]
    points = []   # (step, end time, gap) of consecutive steps of one incarnation
    for a, b in zip(steps, steps[1:]):
        if b["step"] == a["step"] + 1 and not any(a["time"] < s <= b["time"] for s in starts):
            points.append((b["step"], b["time"], b["time"] - a["time"]))
    inj = _first(tl, "fault_injected")
    if inj is None or not points:
        raise RuntimeError(f"{run_dir}: no injection or no steps in the event log; see {run_dir}/report.md")
    cleared = _first(tl, "fault_cleared")
    replace = _first(tl, "failslow_replace", inj["time"])
    verdicts = [e for e in tl if e["event"] == "straggler" and e["time"] >= inj["time"]]
    # the verdict acted on, if any (one with no seat is retried: a later one may act)
    verdict = next((v for v in verdicts if (v.get("decision") or {}).get("action") == "replace"),
                   verdicts[0] if verdicts else None)
    mark = _first(tl, "failslow_mark", inj["time"])
    t_inj = inj["time"]
    step_at = lambda t: max((e["step"] for e in steps if e["time"] <= t), default=0)  # noqa: E731
    if replace is not None:
        t_stop = replace["time"]
        restart = min((s for s in starts if s > t_stop), default=None)
        t_after = restart if restart is not None else float("inf")
    else:
        t_stop = t_after = cleared["time"] if cleared else float("inf")
    windows = {"before": [p for p in points if WARMUP_STEPS < p[0] and p[1] <= t_inj],
               "during": [p for p in points if t_inj < p[1] <= t_stop],
               "after": [p for p in points if p[1] > t_after]}
    healthy = statistics.median(p[2] for p in windows["before"])
    last = steps[-1]
    # Lost over the fault's span only (report: to the slowdown's end; replace: to the first step
    # after the re-form): after it both run healthy, and the host's load drifting over the
    # minutes left would otherwise swamp the figure. The whole-run figure is kept beside it.
    after_t = [e["time"] for e in steps if e["time"] > t_after]
    t_end = min(t_after, last["time"]) if replace is None else (after_t[0] if after_t else last["time"])
    lost = (t_end - t_inj) - (step_at(t_end) - step_at(t_inj)) * healthy
    lost_run = (last["time"] - t_inj) - (last["step"] - step_at(t_inj)) * healthy
    pause = None
    if replace is not None:
        before_t = [e["time"] for e in steps if e["time"] <= t_stop]
        if before_t and after_t:
            pause = after_t[0] - before_t[-1]
    return {"points": points, "progress": [(e["step"], round(e["time"] - t_inj, 3)) for e in steps],
            "windows": {k: [tokens / p[2] for p in v] for k, v in windows.items()},
            "healthy_s": healthy, "lost_s": lost, "lost_run_s": lost_run, "fault_span_s": t_end - t_inj,
            "pause_s": pause, "last_step": last["step"],
            "inject_step": inj.get("step") or step_at(t_inj), "clear_step": step_at(cleared["time"]) if cleared else None,
            "verdict": verdict, "replace": replace, "mark": mark,
            "verdict_step": verdict.get("step") if verdict else None,
            "replace_step": replace.get("step") if replace else None}


# ------------------------------------------------------------------ plot
def plot(runs: dict, path: Path, title: str) -> None:
    """Top: throughput per step over the steps, the moments marked. Bottom: steps done over
    wall time from the injection, against the healthy rate (the re-form pause and the time
    lost show there: a step axis hides them)."""
    plt = pyplot()
    if plt is None:  # matplotlib not installed: the numbers stand without the picture
        return

    colors = {"report": "#c0504d", "replace": "#4878a8"}
    f, (ax, bx) = plt.subplots(2, 1, figsize=(10, 6.4))
    for policy, a in runs.items():
        c = colors[policy]
        xs = [p[0] for p in a["points"]]
        ys = [a["tokens"] / p[2] for p in a["points"]]
        smooth = [statistics.median(ys[max(0, i - 2):i + 3]) for i in range(len(ys))]   # 5-step rolling median
        ax.plot(xs, ys, ".", color=c, alpha=0.25, markersize=3)
        ax.plot(xs, smooth, "-", color=c, label=f"policy = {policy} (5-step rolling median)", linewidth=1.4)
        marks = [(a["verdict_step"], "--", f"{policy}: straggler verdict (step {a['verdict_step']})")]
        if a["replace_step"] is not None:
            marks.append((a["replace_step"], ":", f"{policy}: hand-over to the spare (step {a['replace_step']})"))
        elif a["clear_step"] is not None:
            marks.append((a["clear_step"], "-.", f"{policy}: slowdown ends (step {a['clear_step']})"))
        for step, style, label in marks:
            if step is not None:
                ax.axvline(step, color=c, linestyle=style, linewidth=1.3, label=label)
        t = [p[1] for p in a["progress"] if p[1] >= -5]
        bx.plot(t, [p[0] for p in a["progress"] if p[1] >= -5], "-", color=c, linewidth=1.4,
                label=f"{policy}: {a['lost_s']:.1f} s lost" + (f", re-form pause {a['pause_s']:.1f} s" if a["pause_s"] else ""))
    first = next(iter(runs.values()))
    inj = first["inject_step"]
    ax.axvline(inj, color="black", linewidth=1, label=f"rank 1 slowed 3x (step {inj})")
    end = max(p[1] for a in runs.values() for p in a["progress"])
    healthy = statistics.median(a["healthy_s"] for a in runs.values())
    bx.plot([0, end], [inj, inj + end / healthy], "--", color="grey", linewidth=1, label="healthy rate (before)")
    bx.axvline(0, color="black", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s (rank 0, per step)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    bx.set_xlabel("seconds from the injection")
    bx.set_ylabel("steps done")
    bx.set_xlim(-5, end)
    bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    f.tight_layout()
    f.savefig(path, dpi=90)
    plt.close(f)


# ------------------------------------------------------------------ the row
def run(quick: bool) -> dict:
    from resilient_chaos.runner import run_campaign

    size = SIZES[quick]
    runs, codes, notes = {}, {}, []
    with tempfile.TemporaryDirectory(prefix="bench-failslowpolicy-") as tmp:
        tmp = Path(tmp)
        for policy in POLICIES:
            table = scenario_for(policy, size["steps"], size["slow_s"], size["budget_s"])
            path = tmp / f"{policy}.toml"
            path.write_text(to_toml(table))
            codes[policy] = run_campaign(path, tmp / policy, log=lambda s: print(f"   {s}", flush=True))
            runs[policy] = analyse(tmp / policy / "faulted", tokens_per_step(table))
            runs[policy]["tokens"] = tokens_per_step(table)
    figures, ratios, goals = {}, {}, []
    for policy, a in runs.items():
        for w, label in (("before", "before the injection"),
                         ("during", "slowdown, injection → its end" if policy == "report" else "slowdown, injection → hand-over"),
                         ("after", "after the slowdown ends" if policy == "report" else "after the re-form with the spare")):
            figures[f"{policy}_{w}"] = fig(a["windows"][w], "tokens/s", f"{policy}: {label} (per step)")
        span = "the slowdown's end" if policy == "report" else "the first step after the re-form"
        figures[f"{policy}_lost"] = fig([a["lost_s"]], "s", f"{policy}: wall time lost vs the healthy rate, injection → {span}")
    if runs["replace"]["pause_s"] is not None:
        figures["replace_pause"] = fig([runs["replace"]["pause_s"]], "s", "replace: re-form pause (last step → first step after)")
    med = {(p, w): figures[f"{p}_{w}"]["median"] for p in POLICIES for w in ("before", "during", "after")}
    rel = lambda p, w: round(med[p, w] / med[p, "before"], 3) if med[p, w] and med[p, "before"] else None  # noqa: E731
    ratios["replace_after"] = {"value": rel("replace", "after"), "better": "higher",
                               "label": "replace: throughput after the re-form / before the slowdown"}
    ratios["report_during"] = {"value": rel("report", "during"), "better": "higher",
                               "label": "report: throughput while rank 1 is slow / before (what not acting keeps)"}
    ratios["lost"] = {"value": round(runs["replace"]["lost_s"] / runs["report"]["lost_s"], 3) if runs["report"]["lost_s"] > 0 else None,
                      "better": "lower",
                      "label": f"wall time lost, replace / report ({size['slow_s']:g} s slowdown)"}
    r_after = rel("replace", "after")
    handed = runs["replace"]["replace_step"] is not None
    if not handed:   # the replace run's "after" is then merely after the slowdown's end
        ratios["replace_after"]["label"] += " (NO hand-over happened: after the slowdown ended)"
    goals.append(goal(f"replace restores throughput to within {100 - RESTORED * 100:g}% of before",
                      None if quick or r_after is None else handed and r_after >= RESTORED,
                      f"after / before = {r_after} (report's during / before = {rel('report', 'during')})"
                      + ("" if handed else "; but the replace run handed no seat over (see its verdict's seat)")))
    for policy, a in runs.items():
        v = a["verdict"] or {}
        d = v.get("decision") or {}
        notes.append(f"{policy}: campaign exit {codes[policy]}; verdict at step {a['verdict_step']} "
                     f"({v.get('cause')} on rank {v.get('slow_rank')}, factor {v.get('factor')}, action {d.get('action')}, "
                     f"seat {d.get('seat')}), {(a['verdict_step'] or 0) - a['inject_step']} step(s) after the injection at "
                     f"step {a['inject_step']}"
                     + (f"; hand-over after step {a['replace_step']}, node {a['mark'].get('node') if a['mark'] else '?'} marked, "
                        f"re-form pause {a['pause_s']:.2f} s" if a["replace_step"] is not None and a["pause_s"] else "")
                     + (f"; slowdown ended at step {a['clear_step']}" if a["replace_step"] is None else "")
                     + f"; healthy step {a['healthy_s'] * 1e3:.0f} ms; steps per window "
                     + "/".join(str(len(a["windows"][w])) for w in ("before", "during", "after"))
                     + f"; {a['lost_s']:.1f} s lost in the {a['fault_span_s']:.1f} s from the injection to "
                     + ("the slowdown's end" if a["replace_step"] is None else "the first step after the re-form")
                     + f" ({a['lost_run_s']:.1f} s to the last step, step {a['last_step']}, with the load's drift after it).")
    per_slow_s = runs["report"]["lost_s"] / runs["report"]["fault_span_s"]
    if per_slow_s > 0:
        notes.append(f"Break-even: report loses {per_slow_s:.2f} s per second rank 1 stays slow; replace lost "
                     f"{runs['replace']['lost_s']:.1f} s (detection, hand-over, re-form), so replacing pays for a slowdown longer than "
                     f"~{runs['replace']['lost_s'] / per_slow_s:.0f} s (the cost model decides with its own "
                     "estimate: the remaining steps at the measured factor against the re-form's seconds).")
    notes.append(f"Scenario chaos/scenarios/slow-rank-replace.toml with train.steps = {size['steps']}, the injection at step {INJECT_STEP}, the slowdown "
                 f"{size['slow_s']:g} s long (so report has an after), no reference run; one run per policy, report "
                 "first. Throughput: tokens per step / the wall gap between rank 0's consecutive steps (snapshots and "
                 "the fail-slow boundary included). Report's loss grows with the slowdown's length; replace's is "
                 "detection + hand-over + re-form, whatever the length. After the hand-over the old node probes "
                 "itself and rejoins as a spare, on the same 2 cores. " + load_note() + " at the end.")
    out_dir = BENCH / "results" / ("quick" if quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    png = "failslow_policy-throughput.png"
    plot(runs, out_dir / png, "rank 1 slowed 3x: throughput per step under failslow.policy = report and replace "
                              "(2 nodes x 1 worker + 1 spare)")
    r = row("fail-slow policies: throughput before, during and after a slow rank (issue 26)", figures, ratios, goals, notes)
    r["png"] = [png]
    r["runs"] = {p: {k: a[k] for k in ("healthy_s", "lost_s", "lost_run_s", "fault_span_s", "pause_s", "inject_step",
                                       "clear_step", "verdict_step", "replace_step", "last_step", "points", "progress")}
                 | {"exit": codes[p]}
                 for p, a in runs.items()}
    return r
