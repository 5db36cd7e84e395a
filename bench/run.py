"""One entry point for every benchmark: ``python bench/run.py [NAME ...] [--quick]``.

Why: users pick between torchrun + DCP, torchft, nvidia-resiliency-ext and us
on numbers, and numbers from these shared 2-core machines are only honest when
ours and the anchor's are measured side by side in one run. Each benchmark is
a module ``bench/bench_<name>.py`` with ``run(quick: bool) -> dict`` (see
``common.row``); this script runs the named ones (default: all), writes
``bench/results/NAME.json`` (figures with median/min/max/n, ratios, goals, the
exact command, the date) and PNG plots, then regenerates ``bench/RESULTS.md``
from every JSON present, so rows measured on different days keep their date.

``bench/bench_ckpt.py`` (reshard/convert throughput, another engineer's) has no
``run()``: it is run as a subprocess and its JSON lines become the ``ckpt`` row.

Quick mode (``--quick``) is a smoke test of every row at small sizes and few
repeats, still alternating ours and the anchor (7.4 minutes at load average
12-16 on the shared 2-core machine, 30 s of it the first torch import; the three
rows that start training jobs, recovery, recovery_node and overhead, take 270 s
of it, mostly process start-up). Quick mode judges no goal. Its results go to
``bench/results/quick/`` (JSON, PNG and its own ``RESULTS.md``), never over the
full-mode figures in ``bench/results/`` and ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import fig, goal, plot_figures, row, shown  # noqa: E402

RESULTS = BENCH / "results"
QUICK = RESULTS / "quick"  # quick mode's own JSON, PNG and RESULTS.md: full-mode figures are never overwritten
# Run order: cheap in-process rows first, training jobs last; chaos only reads a report.
ORDER = ["stall", "durable", "restore", "ckpt", "overhead", "sdc", "recovery", "recovery_big", "recovery_node", "lostwork",
         "ownscript", "chaos"]
# Rows of issue 9 that no module measures yet, with why.
PLANNED: dict[str, str] = {}


def names() -> list[str]:
    found = {p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py")}
    return [n for n in ORDER if n in found] + sorted(found - set(ORDER))


def run_ckpt(quick: bool) -> dict:
    """The ckpt row from bench_ckpt.py's JSON lines (one per measurement). Quick: a small
    GPT shape (dim 256), so two sizes really differ (dim 1024 starts at ~0.24 GB)."""
    quick_args = ["--sizes", "0.04", "0.12", "--dim", "256", "--ops", "reshard"]
    cmd = [sys.executable, str(BENCH / "bench_ckpt.py")] + (quick_args if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = []
    for line in proc.stdout.splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    if proc.returncode != 0 and not lines:
        raise RuntimeError(f"bench_ckpt.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    figures, ratios, goals = {}, {}, []
    keep = {"mb_s": ("MB/s", "throughput"), "peak_rss_mb": ("MB", "peak RSS"), "rss_over_baseline_mb": ("MB", "RSS over baseline")}
    for d in lines:
        for k, (unit, what) in keep.items():
            if isinstance(d.get(k), (int, float)):
                figures[f"{d.get('op')}_{d.get('size_gb')}GB_{k}"] = fig([d[k]], unit, f"{d.get('op')} {d.get('size_gb')} GB {what}", 1)
    for op in sorted({d.get("op") for d in lines}):
        mine = sorted((d for d in lines if d.get("op") == op and "rss_over_baseline_mb" in d), key=lambda d: d["size_gb"])
        if len(mine) >= 2 and mine[0]["rss_over_baseline_mb"] > 0:
            small, big = mine[0], mine[-1]
            r = round(big["rss_over_baseline_mb"] / small["rss_over_baseline_mb"], 2)
            grow = big["size_gb"] / small["size_gb"]
            ratios[op] = {"value": r, "label": f"{op}: RSS over baseline at {big['size_gb']} GB / at {small['size_gb']} GB "
                          f"(checkpoint {grow:g}x larger)", "better": "lower"}
            goals.append(goal(f"{op}: peak RSS flat as the checkpoint grows (issue 6)", r <= 1.25,
                              f"RSS over baseline grew {r}x for a {grow:g}x larger checkpoint"))
    res = row("Checkpoint tools: reshard / convert throughput and peak RSS", figures, ratios, goals,
              notes=["One measurement per size (bench_ckpt.py's own design, by the tools' engineer); "
                     "raw JSON lines in results/ckpt.json `lines`. Flat = grows ≤ 1.25x."]
              + (["Quick mode: a narrower GPT (dim 256, vocab 4096) so 0.04 and 0.12 GB really differ in size; "
                  "reshard only (each measurement is a fresh process: their start-up dominates a quick run)."]
                 if quick else []))
    res["lines"] = lines
    res["command"] = shown(cmd)
    return res


def run_one(name: str, quick: bool) -> dict:
    import os

    t0, load0 = time.time(), os.getloadavg()
    if name == "ckpt":
        res = run_ckpt(quick)
    else:
        mod = importlib.import_module(f"bench_{name}")
        res = mod.run(quick)
    res.setdefault("command", f"python bench/run.py {name}{' --quick' if quick else ''}")
    res.setdefault("host", f"{platform.node()}, {_cores()} cores, torch {_torch()}")  # a reader row names its own
    res.update(name=name, quick=quick, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               wall_s=round(time.time() - t0, 1),
               load=" → ".join("/".join(f"{x:.1f}" for x in la) for la in (load0, os.getloadavg())))
    return res


def unjudged(res: dict) -> None:
    """Quick mode judges no goal: its sizes are too small for the issues' goals (fixed per-version
    costs dominate a 64 MB upload, say). The verdict it would give is kept in the detail."""
    verdict = {True: "met", False: "NOT met", None: "not judged"}
    for g in res.get("goals", []):
        g["detail"] = f"judged in full mode only; at quick sizes {verdict[g['met']]}: {g['detail']}"
        g["met"] = None


def _cores() -> int:
    import os

    return os.cpu_count() or 0


def _torch() -> str:
    import torch

    return torch.__version__


# ----------------------------------------------------------------- RESULTS.md
def _fmt(f: dict) -> str:
    if f.get("median") is None:
        return "–"
    m, lo, hi, u = f["median"], f["min"], f["max"], f["unit"]
    g = lambda x: f"{x:.3g}"  # noqa: E731
    spread = f" ({g(lo)}–{g(hi)}, n={f['n']})" if f["n"] > 1 else ""
    return f"{g(m)} {u}{spread}"


def _goal_cell(gl: dict) -> str:
    mark = {True: "met", False: "NOT met", None: "not judged"}[gl["met"]]
    return f"{gl['text']}: **{mark}** ({gl['detail']})"


def render(results: dict[str, dict], quick: bool = False) -> str:
    head = ["# Benchmark results, QUICK MODE", "",
            "**Quick mode** (`python bench/run.py --quick`): small sizes, few repeats, a smoke test that every "
            "row still runs and roughly where it lands. Not the project's figures: those are in "
            "[bench/RESULTS.md](../../RESULTS.md) (full mode).", ""] if quick else ["# Benchmark results", ""]
    out = head + [
           "Generated by `python bench/run.py` (bench/run.py). Every figure: median of several runs, "
           "the spread (min–max) and n; ours and the anchor measured side by side in one run, alternating. "
           "The machine is shared (2 cores, other engineers' tests running), so absolute times are noisy: "
           f"read the ratios. Raw figures: `bench/results/{'quick/' if quick else ''}NAME.json`.", "",
           "## Ratios and goals", "", "| row | ratio | value | goal | measured |", "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        goals = r.get("goals", [])
        ratios = list(r.get("ratios", {}).values())
        if r.get("status") == "pending":
            out.append(f"| {name} | pending | – | {'; '.join(_goal_cell(g) for g in goals) or '–'} | – |")
            continue
        first = True
        for rt in ratios or [{"label": "–", "value": None}]:
            gcell = "; ".join(_goal_cell(g) for g in goals) if first else ""
            unit = rt.get("unit", "x")
            val = "–" if rt.get("value") is None else f"{rt['value']}{unit} ({rt.get('better', 'lower')} is better)"
            when = f"{r['date']}{' (quick mode)' if r.get('quick') and not quick else ''}" if first else ""
            out.append(f"| {name if first else ''} | {rt['label']} | {val} | {gcell} | {when} |")
            first = False
    for name, why in PLANNED.items():
        if name not in results:
            out.append(f"| {name} | pending | – | {why} | – |")
    for name, r in results.items():
        out += ["", f"## {name}: {r.get('title', '')}", "",
                f"- command: `{r.get('command', '')}`" + (" (quick mode)" if r.get("quick") else ""),
                f"- date: {r.get('date', '?')}; host: {r.get('host', '?')}; wall: {r.get('wall_s', '?')} s"
                + (f"; load average (1/5/15 min) at start → end: {r['load']}" if r.get("load") else ""),
                f"- status: {r.get('status', 'measured')}"]
        for g in r.get("goals", []):
            out.append(f"- goal: {_goal_cell(g)}")
        for n in r.get("notes", []):
            out.append(f"- {n}")
        if r.get("figures"):
            out += ["", "| figure | median (min–max, n) |", "| --- | --- |"]
            out += [f"| {f.get('label') or k} | {_fmt(f)} |" for k, f in r["figures"].items()]
        if r.get("ratios"):
            out += ["", "| ratio | value |", "| --- | --- |"]
            out += [f"| {rt['label']} | {'–' if rt['value'] is None else str(rt['value']) + rt.get('unit', 'x')} |"
                    for rt in r["ratios"].values()]
        for p in r.get("png", []):
            out += ["", f"![{name}]({'' if quick else 'results/'}{p})"]
    for name, why in PLANNED.items():
        if name not in results:
            out += ["", f"## {name}: pending", "", f"- {why}"]
    return _portable("\n".join(out) + "\n")


def _portable(text: str) -> str:
    """Commands as anyone can paste them: temp run dirs → RUN, the home directory → ~."""
    import os
    import re
    import tempfile

    tmp = re.escape(tempfile.gettempdir())
    text = re.sub(tmp + r"/bench-[a-z]+-[A-Za-z0-9_]+/[A-Za-z0-9_-]+", "RUN", text)
    return text.replace(os.path.expanduser("~") + "/", "~/")


def _sections(text: str) -> list[tuple[str, str]]:
    """``(name, text)`` of each ``## name: ...`` section of a RESULTS.md, in order ("" the head)."""
    out: list[tuple[str, str]] = [("", "")]
    for line in text.splitlines(keepends=True):
        if line.startswith("## ") and ":" in line:
            out.append((line[3:].split(":", 1)[0].strip(), ""))
        out[-1] = (out[-1][0], out[-1][1] + line)
    return out


def keep_written(old: str, new: str) -> str:
    """``new`` (rendered) with the sections of ``old`` that no row renders (written by hand for
    a tool's measurements: sdc_coverage, etcd_members), each after the section it followed."""
    rendered = _sections(new)
    names = {n for n, _ in rendered}
    kept: dict[str, list[str]] = {}
    before = ""
    for name, body in _sections(old):
        if name and name not in names:
            kept.setdefault(before, []).append(body if body.endswith("\n\n") else body.rstrip("\n") + "\n\n")
        else:
            before = name
    out = []
    for name, body in rendered:
        out.append(body)
        for extra in kept.pop(name, []):
            out.append(extra if body.endswith("\n\n") else "\n" + extra)
    for extras in kept.values():   # what they followed is gone: at the end
        out += ["\n" + e for e in extras]
    return "".join(out).rstrip("\n") + "\n"


def load_all(where: Path = RESULTS) -> dict[str, dict]:
    """The rows' results. A tool's raw data beside them (bench/etcd_members.py writes
    ``etcd_members.json``) is no row: it has no ``status``, and is left out."""
    got = {}
    for n in names() + sorted(p.stem for p in where.glob("*.json")):
        p = where / f"{n}.json"
        if n not in got and p.exists():
            row = json.loads(p.read_text())
            if isinstance(row, dict) and "status" in row:
                got[n] = row
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(names())})")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes, few repeats, no goal judged (a smoke test: minutes, not half an hour); "
                         "writes bench/results/quick/, never the full-mode figures")
    ap.add_argument("--render-only", action="store_true", help="only regenerate RESULTS.md from results/*.json")
    args = ap.parse_args(argv)
    todo = args.names or names()
    unknown = [n for n in todo if n not in names()]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; have {names()}")
    out_dir = QUICK if args.quick else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "RESULTS.md" if args.quick else BENCH / "RESULTS.md"
    failed, t_all = [], time.time()
    for name in [] if args.render_only else todo:
        print(f"== {name}{' (quick)' if args.quick else ''}", flush=True)
        try:
            res = run_one(name, args.quick)
        except Exception as e:  # one broken row must not lose the others
            traceback.print_exc()
            failed.append(name)
            res = row(name, {}, notes=[f"failed: {type(e).__name__}: {str(e)[:500]}"], status="failed")
            res.update(name=name, quick=args.quick, command=f"python bench/run.py {name}{' --quick' if args.quick else ''}",
                       date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        if args.quick:
            unjudged(res)
        for stale in out_dir.glob(f"{name}*.png"):
            if stale.stem == name or stale.stem.removeprefix(f"{name}-").isdigit():
                stale.unlink()
        try:
            # a module may draw its own plots (e.g. a heat-map) and list them in res["png"]
            res["png"] = res.get("png", []) + (plot_figures(name, res, out_dir) if res.get("figures") else [])
        except Exception:  # a plot is not worth the row's numbers
            traceback.print_exc()
            res["png"] = []
        # only the pictures drawn (none without matplotlib: resilient.observe.plots)
        res["png"] = [p for p in res["png"] if (out_dir / p).exists()]
        (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
        for k, rt in res.get("ratios", {}).items():
            print(f"   {rt['label']}: {rt['value']}{rt.get('unit', 'x')}", flush=True)
        print(f"   ({res.get('wall_s', '?')} s)", flush=True)
        for g in res.get("goals", []):
            print(f"   goal: {_goal_cell(g)}", flush=True)
    text = render(load_all(out_dir), quick=args.quick)
    md.write_text(keep_written(md.read_text() if md.exists() else "", text))
    print(f"wrote {md} ({time.time() - t_all:.0f} s in all)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
