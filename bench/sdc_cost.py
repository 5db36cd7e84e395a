"""CPU of the SDC checks per step, and where it goes (a hand tool, for A/B across commits).

The ``sdc`` row runs this measurement after its detection campaign and 1000 clean
steps (minutes); this is the measurement alone: the demo model on 2 gloo ranks
(``bench_sdc.overhead``: a checked and a plain copy of the loop stepped in
alternation, the checked one timed by the monitor's own clocks and per part).
The absolute figures swing with the load of these shared cores from one run to
the next; compare two commits by alternating runs of this tool, not against
numbers from another day.

    python bench/sdc_cost.py [--pairs 25]
    PYTHONPATH=/path/to/other/checkout python bench/sdc_cost.py   # the same, another commit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sdc  # noqa: E402  (bench/ is not a package)

import resilient  # noqa: E402
from resilient.sdc.harness import GlooPool  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=25, help="checked/plain step pairs after 2 warm-up pairs")
    args = ap.parse_args(argv)
    with GlooPool(2, timeout=timedelta(seconds=120)) as pool:
        ovh = pool.run(bench_sdc.overhead, str(bench_sdc.corpus_path()), args.pairs, timeout=timedelta(minutes=20))
    est = bench_sdc.overhead_figures(ovh)
    out = {"code": str(Path(resilient.__file__).parent.parent), "pairs": args.pairs}
    for k in ("direct_cpu", "ab_cpu"):
        _, med, lo, hi = est[k]
        out[k] = {"median": round(med, 4), "ci95": [round(lo, 4), round(hi, 4)]}
    for r, o in enumerate(ovh):
        out[f"rank{r}_ms"] = {"plain_step": round(1e3 * statistics.median(o["plain_cpu"]), 1),
                              "sdc": round(1e3 * statistics.median(o["sdc_cpu"]), 2),
                              **{p: round(1e3 * statistics.median(o[f"part_{p}"]), 2) for p in bench_sdc.PARTS}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
