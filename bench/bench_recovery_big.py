"""recovery_big: kill -9 of a worker with ~1 GB of training state, resilient vs torchrun (issue 5).

Why: issue 5 asks for recovery side by side "on ~1 GB of state": the RAM tier's
point is that restoring does not get slower with the state the way a cold
restart reading storage does. The rows ``recovery`` and ``recovery_node``
use a tiny model so that process start-up, not compute, is what they
measure; this one is the same measurement (:mod:`bench_recovery`: one node,
2 workers, kill -9 of local rank 1, recovery = kill → rank 0's first step
after the new workers' ``run_start``) on a GPT of 92M parameters: fp32
weights + Adam's two moments = 1.03 GiB, sharded over the 2 workers (FSDP2).

Variants, alternating: resilient with warm spares restoring from the node's
RAM store, the same restoring from the durable tier (``snapshot.memory=false``,
file:// on local disk), and plain torchrun restarting the same worker script
cold, restoring from the durable tier. The durable files sit in the page
cache, so "durable" here is the best case of a local disk.

On these 2 CPU cores one step of this model takes seconds: the step after
the restore is inside every figure. ``run_start`` (new workers ready, restore
done) is reported beside it.
"""

from __future__ import annotations

from bench_recovery import DURABLE_EVERY, measure, summarize
from common import goal, row

# ~1 GiB of fp32 weights + Adam moments (12 bytes per parameter); one sequence per worker.
BIG = {"model.dim": 832, "model.n_layers": 11, "model.n_heads": 13, "model.max_seq_len": 32, "train.seq_len": 32,
       "train.global_batch": 2}
VARIANTS = {"resilient_ram": ("launch", {}), "resilient_durable": ("launch", {"snapshot.memory": False}),
            "torchrun": ("torchrun", {})}


def run(quick: bool) -> dict:
    kills = 1 if quick else 2
    got, cmds = measure(VARIANTS, 1, kills, "bench-recovery-big-", BIG)
    figures, ratios = summarize(got, ", 1 GiB of state")
    x = ratios["torchrun_over_resilient_ram"]["value"]
    ready = {n: figures.get(f"{n}_run_start_s", {}).get("median") for n in got}
    tiers = {n: sorted({str(r["tier"]) for r in rs}) for n, rs in got.items()}
    goals = [goal("recovery from RAM several times (≥3x) faster than torchrun + durable, ~1 GB of state (issue 5)",
                  x is not None and x >= 3, f"{x}x (kill → first step); workers ready (restore done): "
                  f"resilient RAM {ready.get('resilient_ram')} s, torchrun {ready.get('torchrun')} s"),
             goal("the RAM variant restores from the node's RAM (tier local)", tiers.get("resilient_ram") == ["local"],
                  f"tiers: {tiers}")]
    notes = [f"1 job per variant, {kills} kills each (kill -9 of local rank 1 at a random point of a step); "
             f"snapshot.every=1, durable_every={DURABLE_EVERY}; model dim 832, 11 layers, seq 32, one sequence per "
             "worker: 92.4M parameters, 1.03 GiB of fp32 weights + Adam moments over 2 workers.",
             f"restore tiers seen: {tiers}.",
             "Commands (RUN = a temp dir): " + "; ".join(f"{k}: `{v}`" for k, v in cmds.items())]
    out = row("Recovery after kill -9 of a worker, ~1 GB of state", figures, ratios, goals, notes)
    out["kills"] = got
    return out
