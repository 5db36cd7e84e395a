"""Coverage of the SDC checks by site × bit class × transient/persistent, measured.

Three gloo ranks (one process each, :class:`resilient.sdc.harness.GlooPool`), the
demo's GPT at a small size replicated on each (the same parameters, each rank its own
batch: data parallel), one sampled step per trial. Rank 1's device flips one bit of
one random element at a site — on the training forward only (transient) or on every
forward and backward it runs (persistent, a bad device) — and each detector is asked
whether it names rank 1 in that step:

* ``default``: what the defaults run on a sampled step: the cross-device replay (every
  rank's forward recomputed by its neighbour, three ranks attribute;
  :mod:`resilient.sdc.crosscheck`) or the checksummed GEMMs (:mod:`resilient.sdc.abft`,
  ``abft_every = 0``: on the steps the budget samples) naming rank 1;
* ``abft_every``: the checksummed GEMMs alone, as ``sdc.abft_every = 1`` runs them.

Memory sites (gradients, parameters, optimizer state at rest, reductions) are hashed
bit for bit by the default checks; their rates are the ``sdc`` row's (bench/RESULTS.md),
not re-measured here. ``python bench/sdc_coverage.py --trials 6`` prints a markdown
table and a JSON line and draws ``bench/results/sdc-coverage.png`` (the heat-map: the
default's columns beside the knob's); a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SITES = {   # name -> (FlipSpec target, tensor)
    "Linear forward": ("activation", "layers.1.feed_forward.w2"),   # (attention.wq: a fused qkv GEMM, not called as a module)
    "grad-input": ("activation_grad", "layers.1.feed_forward.w2"),
    "grad-weight": ("weight_grad", "layers.1.feed_forward.w1.weight"),
    "attention": ("activation", "layers.1.attention"),
    "norm": ("activation", "layers.0.ffn_norm"),
    "block output": ("activation", "layers.1"),
}
BITS = {"sign": 31, "exponent up": 30, "exponent down": 24, "high mantissa": 21}


def _trial(rank, world, site, bit, persistent, seed):
    import torch

    from resilient.gpt.config import ModelConfig
    from resilient.gpt.model import GPT, init_parameters
    from resilient.sdc.abft import attach_abft
    from resilient.sdc.crosscheck import CrossCheck
    from resilient.sdc.inject import BitFlipInjector, FlipSpec

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32))
    init_parameters(model, seed=0)
    target, tensor = SITES[site or "attention"]
    # every site holds at least 4096 elements on each rank (outputs [4, 32, 64], w1's weight)
    spec = FlipSpec(target=target, tensor=tensor, bit=bit, rank=1 if site else world, step=1, persistent=persistent,
                    element=random.Random(seed).randrange(4096))
    # the checks first, the flip after: its hook is prepended, so it strikes before they look (as SdcGuard does)
    gemms = attach_abft(list(model.named_modules()), 2.0, set())
    inj = BitFlipInjector(spec, rank)   # site None: a clean trial (the flip names no rank of the job)
    if inj.here():
        inj.attach(model)
    gemms.arm(True)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randint(0, 256, (4, 33), generator=gen)
    inputs, targets = x[:, :-1], x[:, 1:]

    def loss_of(a, b):
        out = model(a)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), b.reshape(-1))

    inj.current_step = 1
    loss = loss_of(inputs, targets)
    loss.backward()
    abft = [s for s in gemms.collect(1, rank) if not s.harmless]
    gemms.arm(False)
    cc = CrossCheck(0.01, 1, rank=rank, world=world)
    t0 = time.perf_counter()
    cross = cc.run(1, loss, (inputs, targets), loss_of, step_seconds=1.0)
    return {"abft": bool(abft), "cross": [(s.rank, s.evidence["attributed"]) for s in cross],
            "fired": inj.fired, "cross_s": time.perf_counter() - t0}


def draw(rows: list[dict], path: Path) -> None:
    """The heat-map: a row per site × bit class, the default's and the knob's columns, each
    transient and persistent; a cell is the share of trials that named rank 1."""
    from resilient.observe.plots import pyplot

    plt = pyplot()
    if plt is None:   # matplotlib not installed: the table stands without the picture
        return
    cols = [("default", "transient"), ("default", "persistent"), ("abft_every", "transient"), ("abft_every", "persistent")]
    labels = ["default\ntransient", "default\npersistent", "abft_every=1\ntransient", "abft_every=1\npersistent"]
    keys = [(site, bits) for site in SITES for bits in BITS]
    cell = {(r["site"], r["bits"], r["fault"]): r for r in rows}
    grid = [[cell[site, bits, fault][col] / cell[site, bits, fault]["trials"] for col, fault in cols] for site, bits in keys]
    f, ax = plt.subplots(figsize=(6.4, 0.3 * len(keys) + 1.4))
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, (site, bits) in enumerate(keys):
        for j, (col, fault) in enumerate(cols):
            r = cell[site, bits, fault]
            ax.text(j, i, f"{r[col]}/{r['trials']}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), labels, fontsize=7)
    ax.set_yticks(range(len(keys)), [f"{site}: {bits}" for site, bits in keys], fontsize=7)
    ax.set_title("SDC in the compute: found on a sampled step (rank 1 of 3 named)", fontsize=8)
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path, dpi=90)
    plt.close(f)


def main() -> None:
    from resilient.sdc.harness import GlooPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=6, help="random elements per cell")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sdc-coverage.png", help="the heat-map")
    args = ap.parse_args()
    rows = []
    t0 = time.perf_counter()
    with GlooPool(3, timeout=timedelta(seconds=300)) as pool:
        clean = [pool.run(_trial, None, 31, False, seed) for seed in range(args.trials)]   # false alarms?
        for site in SITES:
            for bname, bit in BITS.items():
                for persistent in (False, True):
                    default = knob = 0
                    for t in range(args.trials):
                        res = pool.run(_trial, site, bit, persistent, 1000 + t)
                        default += any(r == 1 and a for r, a in res[0]["cross"]) or res[1]["abft"]
                        knob += res[1]["abft"]
                    rows.append({"site": site, "bits": bname, "fault": "persistent" if persistent else "transient",
                                 "default": default, "abft_every": knob, "trials": args.trials})
    print("| site | bits | fault | default (cross-device replay + GEMM checks, sampled) | `sdc.abft_every=1` |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['site']} | {r['bits']} | {r['fault']} | {r['default']}/{r['trials']} in a sampled step "
              f"| {r['abft_every']}/{r['trials']} in the step |")
    draw(rows, args.out)
    print(json.dumps({"rows": rows, "false_alarms": sum(bool(c[0]["cross"]) or any(r["abft"] for r in c) for c in clean),
                      "clean_trials": len(clean), "cross_s_per_sample": round(sum(c[0]["cross_s"] for c in clean) / len(clean), 4), "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
