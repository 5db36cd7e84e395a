"""Recovery time per tier and the per-step cost of snapshotting every step (a hand tool).

The suite's rows measure the same side by side with the anchors:
``python bench/run.py recovery recovery_node overhead`` (worker kill, node kill
from peer RAM vs torchrun, and the interleaved on/off overhead). This script
stays for quick looks at one tier at a time, without the anchors.

    python bench/memory_tiers.py [--steps N] [--out DIR]

On configs/demo.toml (real agents, a real etcd, real kills):

- local:   1 node x 2 workers, kill -9 one worker → restore from the node store
- peer:    2 nodes x 1 worker (k=1), kill -9 node b, a new node c is started
           at once and takes its place → c restores from a's RAM (includes c's cold start)
- durable: 1 node x 2 workers, kill -9 the whole node, start it again →
           restore from durable storage (file://)

Recovery = kill → first completed step after it (wall clock, from the event log);
``restore_s`` = the restore itself (event ``restore.seconds``, max over ranks).

Overhead: the same 2-node run with snapshot.every=0 (no snapshots) and with
every=1 + replication (k=1); step time = median gap between consecutive
``step`` events of rank 0 (so the capture, outside ``step.seconds``, counts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from launchutil import REPO, Agent, events, steps_done, wait_for, worker_pids  # noqa: E402

from resilient.gpt.data import prepare  # noqa: E402
from resilient_chaos.etcd_testing import embedded_etcd  # noqa: E402

DEMO = REPO / "configs" / "demo.toml"


def sets(steps: int, **extra) -> list[str]:
    base = {"train.steps": steps, "train.eval_every": 0, "train.log_every": 1, "snapshot.durable_every": 10,
            "launch.heartbeat_timeout": 30.0}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def recovery(run: Path, t_kill: float) -> dict:
    after = [e for e in events(run, "step") if e["time"] > t_kill]
    restores = [e for e in events(run, "restore") if e["time"] > t_kill and e["step"] > 0]
    first = min(e["time"] for e in after)
    return {"recovery_s": round(first - t_kill, 2), "restore_s": max(e["seconds"] for e in restores),
            "tiers": sorted({e["tier"] for e in restores}), "restored_step": restores[0]["step"],
            "lost_steps": max(e["step"] for e in events(run, "step") if e["time"] < t_kill) - restores[0]["step"]}


def bench_local(root: Path, etcd, steps: int) -> dict:
    run = root / "local"
    run.mkdir()
    a = Agent(DEMO, run, sets(steps), "n0", endpoint=etcd.endpoint, nproc=2)
    try:
        wait_for(lambda: steps_done(run) >= 15, 300, "steps")
        t = time.time()
        os.kill(worker_pids(run)[1], signal.SIGKILL)
        wait_for(lambda: [e for e in events(run, "step") if e["time"] > t and e["rank"] == 0], 300, "a step after")
        return recovery(run, t)
    finally:
        a.close()


def bench_peer(root: Path, etcd, steps: int) -> dict:
    run = root / "peer"
    run.mkdir()
    over = sets(steps)
    a = Agent(DEMO, run, over, "a", nnodes="2", endpoint=etcd.endpoint, nproc=1, extra_args=["--domain", "r1"])
    b = Agent(DEMO, run, over, "b", nnodes="2", endpoint=etcd.endpoint, nproc=1, extra_args=["--domain", "r2"])
    c = None
    try:
        wait_for(lambda: steps_done(run) >= 15, 300, "steps")
        t = time.time()
        b.kill_node()
        # the replacement node starts now (a spare agent started earlier waits in torch's
        # redundancy list and is not promoted here), so recovery includes its cold start
        c = Agent(DEMO, run, over, "c", nnodes="2", endpoint=etcd.endpoint, nproc=1, extra_args=["--domain", "r3"])
        wait_for(lambda: [e for e in events(run, "step") if e["time"] > t and e["rank"] == 0], 300, "a step after")
        return recovery(run, t)
    finally:
        for x in (a, b, c):
            if x is not None:
                x.close()


def bench_durable(root: Path, etcd, steps: int) -> dict:
    run = root / "durable"
    run.mkdir()
    a = Agent(DEMO, run, sets(steps), "n0", endpoint=etcd.endpoint, nproc=2)
    try:
        wait_for(lambda: [e for e in events(run, "commit") if e["tier"] == "durable"], 300, "durable commit")
        t = time.time()
        a.kill_node()
        a2 = Agent(DEMO, run, sets(steps), "n0", endpoint=etcd.endpoint, nproc=2)
        wait_for(lambda: [e for e in events(run, "step") if e["time"] > t and e["rank"] == 0], 300, "a step after")
        return recovery(run, t)
    finally:
        a.close()
        try:
            a2.close()
        except NameError:
            pass


def step_time(run: Path, skip: int = 5) -> float:
    ts = sorted(e["time"] for e in events(run, "step") if e["rank"] == 0)[skip:]
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


def bench_overhead(root: Path, etcd, steps: int) -> dict:
    out = {}
    for name, extra in (("none", {"snapshot.every": 0}), ("every_step_k1", {"snapshot.every": 1})):
        run = root / f"ovh-{name}"
        run.mkdir()
        over = sets(steps, **extra, **{"snapshot.durable_every": 0})
        ags = [Agent(DEMO, run, over, n, nnodes="2", endpoint=etcd.endpoint, nproc=1) for n in ("a", "b")]
        try:
            for x in ags:
                x.wait(600)
        finally:
            for x in ags:
                x.close()
        out[name] = round(step_time(run), 4)
    out["ratio"] = round(out["every_step_k1"] / out["none"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", default="local,peer,durable,overhead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench-tiers-"))
    prepare("python-stdlib", Path("~/.cache/resilient/data/python-stdlib").expanduser())
    results = {}
    with embedded_etcd() as etcd:
        for name in args.only.split(","):
            results[name] = globals()[f"bench_{name}"](root, etcd, args.steps)
            print(name, json.dumps(results[name]), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
