"""Throughput and peak RSS of ``ckpt reshard`` and ``ckpt convert`` against checkpoint size.

The claim under test: the tools stream, so peak RSS stays flat as the
checkpoint grows while throughput stays roughly constant.

For each size a GPT-shaped fp32 checkpoint (dim 1024, ffn 2816, vocab 16384: 134 MB of
embeddings + 51 MB per layer; as many layers as the size needs, at least 2) is written in the
standard format by the tools' own streaming writer (the Snapshotter needs the
whole state in RAM, two host copies of it, which a 2 GB benchmark should not
depend on). Then each operation runs in a fresh child process (torch and the
tools imported first); its peak RSS is ``VmHWM`` after resetting the
high-water mark (``/proc/self/clear_refs``), reported with the baseline.
One JSON line per measurement on stdout.

Disk: about 3x the largest size at once (source, resharded copy, safetensors
file); each size's files are removed before the next. Reads mostly hit the
page cache (the source was just written): numbers are CPU/memory-bound,
not cold-disk reads.

    python bench/bench_ckpt.py                     # 0.25 0.5 1 2 GB
    python bench/bench_ckpt.py --sizes 0.1 0.2 --dir /tmp/bench --to pp=2,dp=2,tp=2
    python bench/bench_ckpt.py --sizes 0.04 0.12 --dim 256 --ops reshard convert-safetensors  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import torch
from resilient_tools.cli import main
import resilient_tools.reshard, resilient_tools.convert, resilient_tools.layouts, resilient_tools.verify

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
t0 = time.perf_counter()
rc = main(["-q"] + sys.argv[1:])
dt = time.perf_counter() - t0
print(json.dumps({"rc": rc, "seconds": dt, "base_rss_mb": base / 1024, "peak_rss_mb": status("VmHWM") / 1024}))
"""


def write_source(url: str, nbytes: int, dim: int = 1024, hidden: int = 2816, vocab: int = 16384) -> int:
    """A GPT-shaped checkpoint of about ``nbytes`` written tensor by tensor; returns its exact size."""
    import torch

    from resilient_tools.blocks import row_blocks
    from resilient_tools.writer import VersionWriter

    per_layer = (4 * dim * dim + 3 * dim * hidden + 2 * dim) * 4
    fixed = (2 * vocab * dim + dim) * 4
    layers = max(2, round((nbytes - fixed) / per_layer / 2) * 2)  # the smallest is ~0.24 GB
    shapes = {"model/tok_embeddings.weight": (vocab, dim)}
    for i in range(layers):
        for n in ("wq", "wk", "wv", "wo"):
            shapes[f"model/layers.{i}.attention.{n}.weight"] = (dim, dim)
        shapes[f"model/layers.{i}.feed_forward.w1.weight"] = (hidden, dim)
        shapes[f"model/layers.{i}.feed_forward.w3.weight"] = (hidden, dim)
        shapes[f"model/layers.{i}.feed_forward.w2.weight"] = (dim, hidden)
        shapes[f"model/layers.{i}.attention_norm.weight"] = (dim,)
        shapes[f"model/layers.{i}.ffn_norm.weight"] = (dim,)
    shapes["model/norm.weight"] = (dim,)
    shapes["model/output.weight"] = (vocab, dim)
    w = VersionWriter(url, 100, world=1, layout={"pp": 1, "dp": 1, "tp": 1, "world": 1}, compress="none",
                      extra={"config": {"model": {"n_heads": 8, "dim": dim, "n_layers": layers}}})
    g = torch.Generator().manual_seed(0)
    total = 0
    for name, shape in shapes.items():
        w.add_tensor(name, shape, torch.float32)
        for box in row_blocks(shape, 4, 16 << 20):
            w.write(name, box, torch.randn(box.sizes, generator=g))
            total += box.numel * 4
    w.commit()
    return total


def child(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="checkpoint sizes in GB")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--to", default="pp=2,dp=2,tp=2", help="reshard target")
    ap.add_argument("--ops", nargs="+", default=["reshard", "convert-safetensors", "verify"],
                    help="operations to measure (each in a fresh child process)")
    ap.add_argument("--dim", type=int, default=1024,
                    help="model width (ffn 2.75x, vocab 16384, or 4096 below 1024): narrower for small sizes")
    a = ap.parse_args()
    shape = {"dim": a.dim, "hidden": a.dim * 11 // 4, "vocab": 16384 if a.dim >= 1024 else 4096}
    root = a.dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    os.makedirs(root, exist_ok=True)
    free = shutil.disk_usage(root).free
    need = 3.2 * max(a.sizes) * 1e9
    if free < need:
        sys.exit(f"{root}: {free / 1e9:.1f} GB free, need ~{need / 1e9:.1f} GB (3x the largest size)")
    try:
        for gb in a.sizes:
            work = os.path.join(root, f"{gb}gb")
            shutil.rmtree(work, ignore_errors=True)
            t0 = time.perf_counter()
            nbytes = write_source(os.path.join(work, "src"), int(gb * 1e9), **shape)
            write_s = time.perf_counter() - t0
            runs = {
                "reshard": ["reshard", os.path.join(work, "src"), "--to", a.to, os.path.join(work, "out")],
                "convert-safetensors": ["convert", os.path.join(work, "src"), os.path.join(work, "m.safetensors"),
                                        "--format", "safetensors"],
                "verify": ["verify", os.path.join(work, "src")],
            }
            for op, argv in ((op, runs[op]) for op in a.ops):
                r = child(argv)
                print(json.dumps({"op": op, "size_gb": gb, "bytes": nbytes, "seconds": round(r["seconds"], 3),
                                  "mb_s": round(nbytes / 1e6 / r["seconds"], 1),
                                  "peak_rss_mb": round(r["peak_rss_mb"], 1),
                                  "rss_over_baseline_mb": round(r["peak_rss_mb"] - r["base_rss_mb"], 1),
                                  "baseline_rss_mb": round(r["base_rss_mb"], 1),
                                  "source_write_s": round(write_s, 2), "target": a.to if op == "reshard" else None}),
                      flush=True)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
