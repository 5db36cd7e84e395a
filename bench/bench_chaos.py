"""chaos: the chaos soak's outcome (faults survived, steps lost, recovery by fault kind), issue 9.

Why a reader, not a measurement: a soak (``resilient chaos run
chaos/scenarios/soak.toml``) runs for hours (``--budget`` shortens it),
longer than this whole suite may take, so the row reports the newest soak
report instead of running one. Which report:

1. ``$BENCH_CHAOS_REPORT``: a JSON file, or a directory searched as below;
2. otherwise the newest ``*.json`` report under ``runs/chaos/`` (the chaos
   runner's default output folder, git-ignored): a soak summary JSON if the
   chaos tools wrote one, else the campaign's ``faulted/results.json``.

Without any, the row says ``pending`` and how to produce one. The report's
own fields are shown as found: properties with their verdicts, injections by
kind and status, and any numeric summary (faults survived, steps lost,
recovery seconds by fault kind); nothing here is re-measured.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections import Counter
from pathlib import Path

from common import REPO, fig, goal, pending, row

ENV = "BENCH_CHAOS_REPORT"
DEFAULT_DIR = REPO / "runs" / "chaos"
KEPT_DIR = REPO / "bench" / "results" / "chaos-soak"  # the soak report kept in the repository


def find_report(where: str | os.PathLike | None = None) -> Path | None:
    """The report to read: a file given, or the newest JSON report under a folder; without
    either, the newest local run's (runs/chaos/), else the one kept in the repository."""
    if where is None and not os.environ.get(ENV):
        return find_report(DEFAULT_DIR) or find_report(KEPT_DIR)
    where = Path(where or os.environ.get(ENV))
    if where.is_file():
        return where
    if not where.is_dir():
        return None
    found = [p for p in where.rglob("*.json") if p.is_file() and _is_report(p)]
    soak = [p for p in found if "soak" in str(p.relative_to(where))]
    return max(soak or found, key=lambda p: p.stat().st_mtime, default=None)


def _is_report(path: Path) -> bool:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and any(k in body for k in ("properties", "injections", "summary", "faults"))


def _numbers(d: dict, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a (nested) summary, keyed by its dotted path."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[key] = v
        elif isinstance(v, dict):
            out.update(_numbers(v, key + "."))
    return out


def summarize(path: Path) -> dict:
    body = json.loads(path.read_text())
    props = body.get("properties") or []
    inj = body.get("injections") or []
    figures = {}
    summary = body.get("summary") if isinstance(body.get("summary"), dict) else {}
    for key, v in _numbers(summary).items():
        parts = key.split(".")
        unit = "s" if any(x.endswith(("_s", "seconds")) for x in parts) else "steps" if "step" in key else ""
        figures[f"summary.{key}"] = fig([v], unit, key.replace("_", " "), 3)
    per_kind = body.get("per_kind") if isinstance(body.get("per_kind"), dict) else {}
    for kind, k in sorted(per_kind.items()):  # the runner's own summary by fault kind
        figures[f"{kind}.injected"] = fig([k.get("injected", 0)], "faults", f"{kind}: injected", 0)
        rec = k.get("recovery_seconds") or {}
        if rec.get("n"):
            figures[f"{kind}.recovery"] = fig([rec["median"]], "s", f"{kind}: recovery (median; max {rec.get('max')} s)", 2)
        lost = k.get("steps_lost") or {}
        figures[f"{kind}.steps_lost"] = fig([lost.get("total", 0)], "steps", f"{kind}: steps lost (total; max {lost.get('max', 0)})", 0)
    if not per_kind:  # an older report: count its injections by kind and status
        kinds = Counter((i.get("kind", "?"), i.get("status", i.get("outcome", "?"))) for i in inj if isinstance(i, dict))
        for (kind, status), n in sorted(kinds.items()):
            figures[f"injections.{kind}.{status}"] = fig([n], "faults", f"{kind} ({status})", 0)
    held = [p for p in props if p.get("ok", p.get("held", p.get("passed"))) is True]
    failed = [p.get("name", "?") for p in props if p.get("ok", p.get("held", p.get("passed"))) is False]
    goals = [goal("every property of the soak held (no committed step lost, each step committed once, "
                  "recoveries under their bound, nothing leaked)", not failed if props else None,
                  f"{len(held)}/{len(props)} held" + (f"; failed: {failed}" if failed else ""))]
    sc = body.get("scenario") if isinstance(body.get("scenario"), dict) else {}
    name = sc.get("name") if sc else body.get("scenario")
    # The command that made this report: a scaled run carries its own budget (--budget).
    budget = sc.get("budget_seconds")
    command = "resilient chaos run chaos/scenarios/soak.toml" + (f" --budget {budget:g}" if budget else "")
    written = body.get("written_at")
    when = dt.datetime.fromtimestamp(written, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if written else "?"
    notes = [f"read from `{os.path.relpath(path, REPO)}` (newest report; set ${ENV} to choose another); "
             f"scenario: {name or '?'}; written {when}.",
             f"Not measured by this suite: a soak runs for hours. Reproduce: `{command}`."]
    notes += [f"property {p.get('name', '?')}: {p.get('detail', p.get('message', ''))}"[:300] for p in props]
    out = row("Chaos soak: faults survived, steps lost, recovery by fault kind", figures, {}, goals, notes)
    out["command"] = command
    out["report"] = os.path.relpath(path, REPO)
    return out


def run(quick: bool) -> dict:
    path = find_report()
    if path is None:
        where = os.environ.get(ENV) or os.path.relpath(DEFAULT_DIR, REPO)
        return pending("Chaos soak: faults survived, steps lost, recovery by fault kind",
                       f"pending: no chaos soak report found (looked in `{where}`). Run "
                       "`resilient chaos run chaos/scenarios/soak.toml` (hours; `--budget SECONDS` shortens it; "
                       "writes under runs/chaos/ unless `--out DIR`), then `python bench/run.py chaos`, with "
                       f"${ENV}=DIR or a report JSON if the report is elsewhere.")
    return summarize(path)
