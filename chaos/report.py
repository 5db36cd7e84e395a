"""The campaign report: markdown summary + PNG timeline, and the verdict.

A run directory holds every process's ``events.jsonl`` and the runner's
``results.json`` (:func:`write_results`: the property verdicts that need live
information — final-state digests, leak checks — and the injection records).
:func:`report` reads both, writes ``report.md`` and ``timeline.png`` next to
them, and returns the exit code: 0 only when every property holds and no
injection failed. Without ``results.json`` the timeline-only properties are
recomputed, so any recorded run can be judged.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

from resilient.errors import ConfigError
from resilient.observe.goodput import PARTS, Goodput, goodput
from resilient.observe.plots import pyplot

from .injectors import InjectionRecord
from .properties import PropertyResult, check_timeline
from .timeline import NOT_INJECTED, Episode, episodes, load_timeline, tier_of

RESULTS = "results.json"
REPORT_MD = "report.md"
TIMELINE_PNG = "timeline.png"


def write_results(run_dir: str | os.PathLike, *, scenario: str | dict, properties: Iterable[PropertyResult],
                  injections: Iterable[InjectionRecord | dict] = (), extra: dict | None = None) -> Path:
    """Write ``RUN_DIR/results.json`` atomically (the runner calls this last)."""
    body = {
        "scenario": scenario,
        "written_at": time.time(),
        "properties": [p.to_dict() for p in properties],
        "injections": [i if isinstance(i, dict) else i.event_fields() for i in injections],
        **(extra or {}),
    }
    path = Path(run_dir) / RESULTS
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str))
    os.replace(tmp, path)
    return path


def kind_summary(eps: list[Episode], records: Iterable[InjectionRecord | dict] = (), pacing: Iterable[dict] = ()) -> dict:
    """Per fault kind, for results.json (and bench/RESULTS.md): faults
    injected, skipped and failed; restores and their recovery time (fault →
    first step after the restore), steps lost; for paced faults, the time
    back to full strength (every seat filled, steps made again)."""
    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "mean": round(sum(xs) / len(xs), 3), "median": round(xs[len(xs) // 2], 3), "max": round(xs[-1], 3)}

    out: dict[str, dict] = {}
    for r in records:
        d = r if isinstance(r, dict) else r.event_fields()
        row = out.setdefault(str(d.get("fault")), {"injected": 0, "skipped": 0, "failed": 0})
        st = d.get("status")
        row["injected" if st in ("injected", "cleared") else st if st in ("skipped", "failed") else "injected"] += 1
        if st == "skipped":
            row["skip_reason"] = d.get("detail", "")
    for kind, row in out.items():
        group = [e for e in eps if e.kind == kind and e.status not in NOT_INJECTED]
        rec = [e.recovery_seconds for e in group if e.recovery_seconds is not None]
        lost = [e.steps_lost for e in group if e.steps_lost is not None]
        row["restores"] = sum(1 for e in group if e.restored_at is not None)
        row["recovery_seconds"] = stats(rec)
        row["steps_lost"] = {"total": sum(lost), "max": max(lost, default=0)}
        ready = [p["ready_seconds"] for p in pacing if p.get("kind") == kind and "ready_seconds" in p]
        if ready:
            row["full_strength_seconds"] = stats(ready)
    return out


def failed_record(kind: str, target: str, fault_id: str, error: BaseException) -> InjectionRecord:
    """The record of an injection that raised: reported, and fails the run."""
    return InjectionRecord(kind, target, "failed", fault_id, time.time(), detail=f"{type(error).__name__}: {error}")


def _rel(t: float | None, t0: float) -> str:
    return "—" if t is None else f"{t - t0:+.2f} s"


def _esc(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(name: str, timeline: list[dict], eps: list[Episode], props: list[PropertyResult],
                    injections: list[dict], png: str | None = TIMELINE_PNG, good: Goodput | None = None) -> str:
    ok = verdict(props, injections)
    t0 = timeline[0]["time"] if timeline else 0.0
    t1 = timeline[-1]["time"] if timeline else 0.0
    steps = [e["step"] for e in timeline if e.get("event") == "step" and "step" in e]
    lines = [
        f"# Chaos report: {name} — {'PASS' if ok else 'FAIL'}",
        "",
        f"- events: {len(timeline)} over {t1 - t0:.1f} s; last step {max(steps) if steps else '—'}",
        f"- faults injected: {sum(1 for i in injections if i.get('status') in ('injected', 'cleared'))}, "
        f"skipped: {sum(1 for i in injections if i.get('status') == 'skipped')}, "
        f"failed to inject: {sum(1 for i in injections if i.get('status') == 'failed')}",
        "",
        "## Properties",
        "",
        "| property | verdict | detail |",
        "| --- | --- | --- |",
    ]
    if not props:
        lines.append("| (none checked) | FAIL | a run with no property checked proves nothing |")
    lines += [f"| {p.name} | {'PASS' if p.ok else '**FAIL**'} | {_esc(p.detail)} |" for p in props]
    lines += [
        "",
        "## Faults",
        "",
        "Times are relative to the first event. Recovery = fault → first step after the restore.",
        "",
        "| fault | kind | target | status | injected at | detected at | restored at | recovered at | recovery | steps lost | tier |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ep in eps:
        rec = "—" if ep.recovery_seconds is None else f"{ep.recovery_seconds:.2f} s"
        lost = "—" if ep.steps_lost is None else str(ep.steps_lost)
        lines.append(f"| {ep.fault_id} | {ep.kind} | {_esc(ep.target)} | {ep.status} | {_rel(ep.injected_at, t0)} | {_rel(ep.detected_at, t0)} | "
                     f"{_rel(ep.restored_at, t0)} | {_rel(ep.recovered_at, t0)} | {rec} | {lost} | {ep.tier or '—'} |")
    odd = [i for i in injections if i.get("status") in ("skipped", "failed")]
    if odd:
        lines += ["", "## Not injected", "", "| fault | kind | target | status | reason |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {i.get('fault_id')} | {i.get('fault')} | {_esc(i.get('target'))} | **{i.get('status').upper()}** | {_esc(i.get('detail'))} |" for i in odd]
    by_kind: dict[str, list[Episode]] = {}
    for ep in eps:
        if ep.status not in NOT_INJECTED:
            by_kind.setdefault(ep.kind, []).append(ep)
    if by_kind:
        lines += ["", "## Per fault kind", "", "| kind | faults | recovered | mean recovery | max recovery | steps lost |", "| --- | --- | --- | --- | --- | --- |"]
        for kind, group in sorted(by_kind.items()):
            recs = [e.recovery_seconds for e in group if e.recovery_seconds is not None]
            lost = sum(e.steps_lost or 0 for e in group)
            mean = f"{sum(recs) / len(recs):.2f} s" if recs else "—"
            mx = f"{max(recs):.2f} s" if recs else "—"
            lines.append(f"| {kind} | {len(group)} | {len(recs)} | {mean} | {mx} | {lost} |")
    lines += goodput_markdown(good if good is not None else goodput(timeline))
    if png:
        lines += ["", f"![timeline]({png})"]
    return "\n".join(lines) + "\n"


PART_LABELS = {"productive": "productive (steps kept)", "redone": "redone (steps computed again)",
               "snapshot_stall": "snapshot stalls", "startup": "start-up", "detection": "fault → detected",
               "recovery": "recovery (detected → first step)", "other": "other (shutdown, idle)"}
PART_COLORS = {"productive": "tab:green", "redone": "tab:orange", "snapshot_stall": "tab:olive",
               "startup": "tab:blue", "detection": "tab:red", "recovery": "tab:purple", "other": "lightgray"}


def goodput_markdown(g: Goodput) -> list[str]:
    """The goodput section: the wall time split and what each fault kind cost."""
    if not g.wall > 0:
        return []
    lines = ["", "## Goodput", "",
             f"Effective training time ratio: **{100 * (g.ratio or 0):.1f}%** of {g.wall:.1f} s of wall time "
             f"(time of steps kept / wall time; {g.steps_kept} steps kept, {g.steps_redone} computed again). "
             "Each part is defined in resilient/observe/goodput.py.", "",
             "| part | seconds | share |", "| --- | --- | --- |"]
    lines += [f"| {PART_LABELS[p]} | {v:.2f} | {100 * v / g.wall:.1f}% |" for p, v in g.parts().items()]
    if g.by_cause:
        lines += ["", "| cause | injected | incidents | detection | recovery | redone | steps redone | cost |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {c.injected} | {c.incidents} | {c.detection_s:.2f} s | {c.recovery_s:.2f} s | "
                  f"{c.redone_s:.2f} s | {c.redone_steps} | {c.cost_s:.2f} s |" for k, c in sorted(g.by_cause.items())]
    return lines


def plot_timeline(timeline: list[dict], eps: list[Episode], path: str | os.PathLike, title: str = "",
                  good: Goodput | None = None) -> Path | None:
    """Step against time per rank; faults (red), restores (▲) and recoveries
    (green) marked; below, the goodput band (what each stretch of wall time was).
    Uses the Agg backend: no display needed. None: not drawn (no matplotlib)."""
    plt = pyplot()
    if plt is None:  # matplotlib not installed: the numbers stand without the picture
        return None

    t0 = timeline[0]["time"] if timeline else 0.0
    fig, (ax, band) = plt.subplots(2, 1, figsize=(11, 5.8), sharex=True, gridspec_kw={"height_ratios": [8, 1]})
    _goodput_band(band, good if good is not None else goodput(timeline), t0)
    series: dict[tuple, list[tuple[float, float]]] = {}
    nan = float("nan")
    for e in timeline:
        key = (e.get("node"), e.get("rank"))
        if e.get("event") == "step" and "step" in e:
            series.setdefault(key, []).append((e["time"] - t0, e["step"]))
        elif e.get("event") in ("run_start", "restore") and series.get(key):
            series[key].append((nan, nan))  # a restart: do not join across it
    for (node, rank), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", ms=3, lw=1, label=f"{node}/r{rank}")
    commits = [(e["time"] - t0, e["step"]) for e in timeline if e.get("event") == "commit" and tier_of(e) == "durable" and "step" in e]
    if commits:
        ax.plot(*zip(*commits), "s", ms=4, mfc="none", color="gray", label="durable commit")
    seen: set[str] = set()

    def once(label: str) -> str | None:
        if label in seen:
            return None
        seen.add(label)
        return label

    for ep in eps:
        color = "gray" if ep.status in NOT_INJECTED else "red"
        ax.axvline(ep.injected_at - t0, color=color, ls="--", lw=1, label=once("fault" if color == "red" else "fault (not injected)"))
        ax.annotate(f"{ep.fault_id} {ep.kind}" + (f" ({ep.status})" if ep.status in NOT_INJECTED else ""), (ep.injected_at - t0, 1),
                    xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7, color=color)
        if ep.restored_at is not None:
            ax.plot([ep.restored_at - t0], [ep.restore_step or 0], "^", color="purple", ms=7, label=once("restore (step restored)"))
        if ep.recovered_at is not None:
            ax.axvline(ep.recovered_at - t0, color="green", ls=":", lw=1, label=once("recovered"))
    band.set_xlabel("time since first event (s)")
    ax.set_ylabel("step")
    ax.set_title(title or "training progress under faults")
    if series or commits or eps:
        ax.legend(loc="lower right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _goodput_band(ax: Any, g: Goodput, t0: float) -> None:
    """One horizontal band: each stretch of wall time coloured by its goodput part."""
    for part in PARTS:
        bars = [(a - t0, b - a) for a, b, p in g.spans if p == part]
        share = f" {100 * getattr(g, part) / g.wall:.0f}%" if g.wall > 0 else ""
        if bars:
            ax.broken_barh(bars, (0, 1), color=PART_COLORS[part], linewidth=0, label=f"{part.replace('_', ' ')}{share}")
    ax.set_yticks([])
    ax.set_ylabel("goodput", rotation=0, ha="right", va="center")
    if g.spans:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=len(PARTS), fontsize=7, frameon=False)


def verdict(props: list[PropertyResult], injections: list[dict]) -> bool:
    """Pass only when at least one property was checked, all hold, and no
    injection failed."""
    return bool(props) and all(p.ok for p in props) and not any(i.get("status") == "failed" for i in injections)


def report(run_dir: str | os.PathLike, *, bound: timedelta = timedelta(seconds=60), steps: int | None = None) -> int:
    """Write report.md and timeline.png for ``run_dir``; return the exit
    code (0 = every property holds). ``bound``/``steps`` are used only when
    results.json is absent and the timeline properties are recomputed."""
    run_dir = Path(run_dir)
    timeline = load_timeline(run_dir)
    if not timeline:
        raise ConfigError(f"{run_dir}: no events found; not a chaos run directory, or its job never started")
    eps = episodes(timeline)
    res_path = run_dir / RESULTS
    if res_path.exists():
        try:
            results = json.loads(res_path.read_text())
            if not isinstance(results, dict):
                raise ValueError("not a JSON object")
            props = [PropertyResult.from_dict(p) for p in results.get("properties", [])]
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:
            raise ConfigError(f"{res_path} is unreadable ({e}); it is truncated or not a campaign's results: "
                              "run the campaign again") from None
        injections = list(results.get("injections", []))
        scen = results.get("scenario", run_dir.name)
        name = scen.get("name", run_dir.name) if isinstance(scen, dict) else str(scen)
    else:
        # No results: the campaign did not finish (interrupted), so nothing judged the final
        # state or the leaks. What the timeline shows is reported, but never as a pass.
        props = [PropertyResult("campaign_finished", False, f"no {RESULTS}: the campaign was interrupted before "
                                "it judged the run; the properties below are recomputed from the timeline only"),
                 *check_timeline(timeline, eps, bound=bound, steps=steps)]
        injections = [{k: e.get(k) for k in ("fault_id", "fault", "target", "status", "detail")}
                      for e in timeline if e.get("event") == "fault_injected" and "request" not in e]
        name = run_dir.name
    good = goodput(timeline)
    drawn = plot_timeline(timeline, eps, run_dir / TIMELINE_PNG, title=name, good=good)
    (run_dir / REPORT_MD).write_text(render_markdown(name, timeline, eps, props, injections,
                                                     png=TIMELINE_PNG if drawn else None, good=good))
    return 0 if verdict(props, injections) else 1
