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

From peer RAM (issue 5 asks for it at this size too): the ``standby`` scenario
of :mod:`bench_recovery_node` on the same model, 2 nodes × 1 worker (dp=2
across nodes, each node's 0.55 GB replicated to the other every step), kill -9
of node b; a standby node started before the kill takes its seat and restores
b's shards from the copy in node a's RAM, over the network; torchrun's
standby restores from the durable tier.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench_recovery import DURABLE_EVERY, measure, summarize
from bench_recovery_node import _resilient, _torchrun
from common import drop_dir, fig, goal, ratio, row

# ~1 GiB of fp32 weights + Adam moments (12 bytes per parameter); one sequence per worker.
BIG = {"model.dim": 832, "model.n_layers": 11, "model.n_heads": 13, "model.max_seq_len": 32, "train.seq_len": 32,
       "train.global_batch": 2}
VARIANTS = {"resilient_ram": ("launch", {}), "resilient_durable": ("launch", {"snapshot.memory": False}),
            "torchrun": ("torchrun", {})}


def node_kills(rounds: int, cmds: dict) -> dict[str, list[dict]]:
    """Node kill with a standby taking the seat, resilient (peer RAM) and torchrun, alternating."""
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-big-node-"))
    got: dict[str, list[dict]] = {}
    try:
        for i in range(rounds):
            for who, fn in (("resilient_peer", _resilient), ("torchrun_node", _torchrun))[::1 if i % 2 == 0 else -1]:
                node_cmds: dict = {}
                got.setdefault(who, []).extend(fn(root, i, 1, "standby", node_cmds, BIG))
                cmds[who] = next(iter(node_cmds.values()))
    finally:
        drop_dir(root)
    return got


def run(quick: bool) -> dict:
    kills = 1 if quick else 2
    got, cmds = measure(VARIANTS, 1, kills, "bench-recovery-big-", BIG)
    figures, ratios = summarize(got, ", 1 GiB of state")
    nodes = node_kills(1 if quick else 2, cmds)
    for who, label in (("resilient_peer", "resilient, node kill, standby restores from peer RAM"),
                       ("torchrun_node", "torchrun, node kill, standby restores from durable")):
        rs = nodes.get(who, [])
        figures[who] = fig([r["recovery_s"] for r in rs], "s", f"{label}, 1 GiB of state", 3)
        figures[f"{who}_run_start_s"] = fig([r["run_start_s"] for r in rs], "s", f"{label}: new workers ready", 3)
        figures[f"{who}_restore_s"] = fig([r["restore_s"] for r in rs if r.get("restore_s") is not None], "s",
                                          f"{label}: restore itself", 3)
    ratios["torchrun_over_resilient_peer"] = ratio(figures["torchrun_node"], figures["resilient_peer"],
                                                   "torchrun / resilient, node kill, standby from peer RAM, "
                                                   "1 GiB of state (x faster)", "higher")
    got.update(nodes)
    x = ratios["torchrun_over_resilient_ram"]["value"]
    ready = {n: figures.get(f"{n}_run_start_s", {}).get("median") for n in got}
    tiers = {n: sorted({str(r["tier"]) for r in rs}) for n, rs in got.items()}
    goals = [goal("recovery from RAM several times (≥3x) faster than torchrun + durable, ~1 GB of state (issue 5)",
                  x is not None and x >= 3, f"{x}x (kill → first step); workers ready (restore done): "
                  f"resilient RAM {ready.get('resilient_ram')} s, torchrun {ready.get('torchrun')} s"),
             goal("the RAM variant restores from the node's RAM (tier local)", tiers.get("resilient_ram") == ["local"],
                  f"tiers: {tiers}"),
             goal("node kill: the standby restores from peer RAM (tier peer)", tiers.get("resilient_peer") == ["peer"],
                  f"tiers: {tiers}"),
             goal("node kill: recovery from peer RAM several times (≥3x) faster than torchrun + durable, ~1 GB",
                  (ratios["torchrun_over_resilient_peer"]["value"] or 0) >= 3,
                  f"{ratios['torchrun_over_resilient_peer']['value']}x (kill → first step); workers ready: resilient "
                  f"{ready.get('resilient_peer')} s, torchrun {ready.get('torchrun_node')} s")]
    notes = [f"1 job per variant, {kills} kills each (kill -9 of local rank 1 at a random point of a step); "
             f"snapshot.every=1, durable_every={DURABLE_EVERY}; model dim 832, 11 layers, seq 32, one sequence per "
             "worker: 92.4M parameters, 1.03 GiB of fp32 weights + Adam moments over 2 workers.",
             f"restore tiers seen: {tiers}.",
             "Node kill (standby): 2 nodes × 1 worker, the same model; the standby starts 20 s before the kill; "
             f"{len(nodes.get('resilient_peer', []))} kill(s) per launcher, one job each, alternating. "
             "Restore-done times (new workers ready): resilient "
             f"{figures['resilient_peer_run_start_s'].get('median')} s, torchrun "
             f"{figures['torchrun_node_run_start_s'].get('median')} s.",
             "Commands (RUN = a temp dir): " + "; ".join(f"{k}: `{v}`" for k, v in cmds.items())]
    out = row("Recovery after kill -9 of a worker or a node, ~1 GB of state", figures, ratios, goals, notes)
    out["kills"] = got
    return out
