"""gpu: what one lent GPU showed (bench/gpu_check.py), read from its stored summaries.

Why a reader: the GPU machine is lent to some sessions only, for minutes, and
never to CI; ``python bench/gpu_check.py --out bench/results/gpu-check`` runs
there and its JSON summaries are kept in the repository. This row shows them
as found (nothing is re-measured here): MFU of the ~1B model, the per-step
snapshot stall (blocking, and on a side stream), restore from host RAM, the
cost of pinned host memory, and the trainer's correctness checks on CUDA
(bitwise-repeatable run, worker kill restored from the node's RAM, a bit flip
detected and rolled back), and issue 5's recovery on ~1 GiB of state where a
step takes milliseconds (when the stored check has it).
"""

from __future__ import annotations

import json

from common import REPO, fig, goal, pending, ratio, row

DIR = REPO / "bench" / "results" / "gpu-check"
TITLE = "GPU (one H200): MFU, snapshot stall, restore, pinned memory, trainer checks on CUDA"


def _load(name: str) -> dict:
    p = DIR / name
    return json.loads(p.read_text()) if p.exists() else {}


def summarize(full: dict, pinned: dict) -> dict:
    checks = full.get("checks", {})
    prof = checks.get("profile", {})
    stall = prof.get("stall", {})
    figures, ratios = {}, {}
    if prof.get("mfu") is not None:
        figures["mfu"] = fig([prof["mfu"] * 100], "%", f"MFU, {prof.get('params', 0) / 1e9:.2f}B params, seq "
                             f"{prof.get('seq_len')}, batch {prof.get('batch')}, bf16, SDPA {prof.get('sdpa')}", 3)
        figures["tokens"] = fig([prof["tokens_per_s"]], "tokens/s", "training throughput (one GPU)", 0)
    for mode in ("plain", "blocking", "side_stream"):
        if f"{mode}_step_s" in stall:
            figures[f"step_{mode}"] = fig([stall[f"{mode}_step_s"]], "s", f"step time, {mode.replace('_', ' ')}"
                                          + ("" if mode == "plain" else f" snapshot every step "
                                             f"({prof.get('snapshot_bytes_gb')} GB)"), 4)
    if "step_side_stream" in figures and "step_plain" in figures:
        ratios["side_stream"] = ratio(figures["step_side_stream"], figures["step_plain"],
                                      "step with a snapshot every step on a side stream / without")
        ratios["blocking"] = ratio(figures["step_blocking"], figures["step_plain"],
                                   "step with a blocking snapshot every step / without")
    for src, tag in ((prof, "first run"), (pinned.get("checks", {}).get("profile", {}), "second run")):
        r = src.get("restore") or {}
        if r.get("seconds"):
            figures[f"restore_{tag}"] = fig([r["seconds"]], "s", f"restore {src.get('snapshot_bytes_gb')} GB from "
                                            f"host RAM into the GPU ({r.get('gb_s')} GB/s; {tag})", 3)
            for part, what in (("stage_s", "reading + verifying into host staging"),
                               ("copy_s", "copying host→device from pageable staging")):
                if r.get(part) is not None:
                    figures[f"restore_{part}"] = fig([r[part]], "s", f"of which {what}", 3)
    pin = pinned.get("checks", {}).get("pinned", {})
    for conf, label in (("default", "cudaHostAlloc (torch default)"),
                        ("host_register_8", "malloc + cudaHostRegister, 8 threads")):
        p = pin.get(conf) or {}
        if "alloc_3x4GiB_s" in p:
            figures[f"pin_{conf}"] = fig([p["alloc_3x4GiB_s"]], "s", f"allocate 3 x 4 GiB pinned: {label}", 3)
    if "pin_default" in figures and "pin_host_register_8" in figures:
        ratios["pin"] = ratio(figures["pin_host_register_8"], figures["pin_default"],
                              "pinned allocation, cudaHostRegister on 8 threads / cudaHostAlloc")
    d = pin.get("default") or {}
    if d.get("d2h_pinned_GBps"):
        figures["d2h_pinned"] = fig([d["d2h_pinned_GBps"]], "GB/s", "device→host copy into pinned memory", 1)
        figures["d2h_pageable"] = fig([d["d2h_pageable_GBps"]], "GB/s", "device→host copy into pageable memory", 1)
    goals = []
    if "side_stream" in ratios:
        share = ratios["side_stream"]["value"] - 1
        goals.append(goal("a snapshot of parameters + Adam state every step costs ≤ 2% of the step on a GPU "
                          "(issue 5's overhead goal, the capture part)", share <= 0.02, f"{share:+.1%} per step"))
    t, k, f = checks.get("trainer", {}), checks.get("kill", {}), checks.get("flip", {})
    if t:
        ok = bool(t.get("bitwise_repeatable") and k.get("equal_to_ref") and f.get("equal_to_ref")
                  and [r.get("tier") for r in k.get("restores", [])] == ["local"])
        goals.append(goal("on CUDA (nccl, bf16): a run is bitwise repeatable; a killed worker's replacement "
                          "restores from the node's RAM and ends bitwise equal; a flipped parameter bit is "
                          "detected, rolled back, and the run ends bitwise equal", ok,
                          f"repeatable {t.get('bitwise_repeatable')}, kill {k.get('equal_to_ref')} "
                          f"(tiers {[r.get('tier') for r in k.get('restores', [])]}), flip {f.get('equal_to_ref')} "
                          f"(events {f.get('sdc_events')})"))
    rb = checks.get("recovery_big", {})
    if rb.get("median_s"):
        med = rb["median_s"]
        for who, label in (("resilient_ram", "resilient, warm spare, RAM restore"),
                           ("torchrun", "torchrun restart + durable restore")):
            if med.get(who) is not None:
                figures[f"big_{who}"] = fig([med[who]], "s", f"{label}, 1 GiB of state, kill → first step (one GPU)", 3)
                figures[f"big_{who}_ready"] = fig([med[f"{who}_run_start_s"]], "s", f"{label}: new worker ready", 3)
        x = rb.get("torchrun_over_resilient")
        goals.append(goal("recovery from RAM several times (≥3x) faster than torchrun + durable, ~1 GB of state, "
                          "kill → first step on a GPU (issue 5)", x is not None and x >= 3, f"{x}x"))
    notes = [f"measured on {full.get('gpu', '?')} (a lent machine: 16 cores), torch {full.get('torch', '?')}; "
             "read from `bench/results/gpu-check/` (gpu_check.json: the full check; gpu_check_pinned.json: "
             "the pinned-memory check and a second profile with the restore's time split); nothing re-measured here.",
             "Reproduce on a GPU machine: `python bench/gpu_check.py --out bench/results/gpu-check` (about 5 min).",
             f"arithmetic probes with their CUDA cases: {checks.get('probes', {}).get('tail')}."]
    out = row(TITLE, figures, ratios, goals, notes)
    out["command"] = "python bench/gpu_check.py --out bench/results/gpu-check"
    out["host"] = f"{full.get('gpu', '?')} (lent), torch {full.get('torch', '?')}"
    return out


def run(quick: bool) -> dict:
    full, pinned = _load("gpu_check.json"), _load("gpu_check_pinned.json")
    if not full:
        return pending(TITLE, "pending: no GPU check stored; on a GPU machine run "
                              "`python bench/gpu_check.py --out bench/results/gpu-check`.")
    return summarize(full, pinned)
