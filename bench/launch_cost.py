"""What one ``resilient launch`` costs around its training (a hand tool, for A/B across commits).

Every run, every relaunch of a node and every test that launches a job pays the launcher's
start (imports, the embedded etcd, the warm zygote, the rendezvous) and its end (the workers,
the zygote, the agent exiting). This times them on a one-node demo of 5 tiny steps, where
they are nearly all of the run: from the command's start to the agent's ``agent_start``
event, to its ``rendezvous``, from the last ``run_end`` to ``agent_stop``, from there to the
process's exit; and the CPU of the launcher with everything it waited for (the zygote and
its forked workers, the etcd), from ``wait4``.

    python bench/launch_cost.py [--pairs 4] [--other /path/to/other/checkout]

With ``--other``, each pair runs the other checkout's launcher first (its own tree as the
working directory and first on PYTHONPATH), then this one's, so load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = {"model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.max_seq_len": 32, "train.seq_len": 32,
        "train.global_batch": 8, "train.steps": 5, "train.warmup_steps": 2, "train.eval_every": 0,
        "train.log_every": 1, "data.source": '""', "snapshot.every": 0}
PHASES = ("to agent_start", "to rendezvous", "run_end to agent_stop", "agent_stop to exit", "total", "cpu")


def one(tree: Path, corpus: Path, work: Path) -> dict[str, float]:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"{k}={v}" for k, v in {**TINY, "data.path": json.dumps(str(corpus))}.items()]
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--run-dir", str(run), "--nproc-per-node", "2",
           *[a for s in sets for a in ("--set", s)], str(tree / "configs" / "demo.toml")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree)] +
                                                       ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    end = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed in {tree} ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    first: dict[str, float] = {}
    for e in events:
        first.setdefault(e["event"], e["time"])
    last_end = max(e["time"] for e in events if e["event"] == "run_end")
    return {"to agent_start": first["agent_start"] - t0, "to rendezvous": first["rendezvous"] - t0,
            "run_end to agent_stop": first["agent_stop"] - last_end, "agent_stop to exit": end - first["agent_stop"],
            "total": end - t0, "cpu": usage.ru_utime + usage.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--other", type=Path, help="another checkout, run first in each pair")
    args = ap.parse_args()
    from resilient.gpt.data import prepare

    trees = {"other": args.other.resolve()} if args.other else {}
    trees["this"] = REPO
    with tempfile.TemporaryDirectory(prefix="launch-cost-") as tmp:
        work = Path(tmp)
        corpus = prepare("python-stdlib", work / "corpus", max_bytes=400_000)
        got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for i in range(args.pairs):
            for name, tree in trees.items():
                got[name].append(one(tree, corpus, work))
                print(f"pair {i + 1}/{args.pairs} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got[name][-1].items()),
                      flush=True)
    print(f"\nmedians over {args.pairs} runs (seconds; cpu: seconds of CPU), load average {os.getloadavg()[0]:.1f}:")
    for name, runs in got.items():
        print(f"  {name:<5} " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in PHASES))


if __name__ == "__main__":
    main()
