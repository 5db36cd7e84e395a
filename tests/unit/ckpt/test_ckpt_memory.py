"""Streaming, measured: reshard, convert and verify a checkpoint larger than the memory they may use.

A ~240 MB checkpoint is written by the real Snapshotter; a child process
(torch and the tools imported first, so the baseline is the interpreter)
reshards it to another layout (verifying every chunk it reads) and converts it to safetensors.
Its peak RSS (``VmHWM``, reset after the imports) may grow by at most 120 MB over the baseline:
less than the checkpoint, so nothing can have held the whole model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

CHILD = r"""
import json, sys
import torch
from resilient_tools.cli import main
import resilient_tools.reshard, resilient_tools.convert, resilient_tools.verify, resilient_tools.layouts

def status(key):  # kB; VmHWM is per address space, so (unlike ru_maxrss) exec does not inherit the parent's
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the current RSS
base = status("VmRSS")
src, out = sys.argv[1], sys.argv[2]
rcs = [main(["-q", "reshard", src, "--to", "pp=2,dp=2,tp=2", out + "/resharded"]),
       main(["-q", "convert", src, out + "/model.safetensors", "--format", "safetensors"])]
peak = status("VmHWM")
print(json.dumps({"rcs": rcs, "base_mb": base / 1024, "peak_mb": peak / 1024}))
"""

LIMIT_MB = 120


def write_checkpoint(url: str) -> int:
    """GPT-shaped fp32 tensors, ~240 MB, written by the real Snapshotter (16 MiB chunks)."""
    from resilient.snapshot import Snapshotter
    dim, hid, vocab, layers = 1024, 2816, 16384, 2
    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(vocab, dim, generator=g), "norm.weight": torch.ones(dim),
          "output.weight": torch.randn(vocab, dim, generator=g)}
    for i in range(layers):
        for n in ("wq", "wk", "wv", "wo"):
            sd[f"layers.{i}.attention.{n}.weight"] = torch.randn(dim, dim, generator=g)
        sd[f"layers.{i}.feed_forward.w1.weight"] = torch.randn(hid, dim, generator=g)
        sd[f"layers.{i}.feed_forward.w3.weight"] = torch.randn(hid, dim, generator=g)
        sd[f"layers.{i}.feed_forward.w2.weight"] = torch.randn(dim, hid, generator=g)
        sd[f"layers.{i}.attention_norm.weight"] = torch.ones(dim)
        sd[f"layers.{i}.ffn_norm.weight"] = torch.ones(dim)
    snap = Snapshotter(url, every=1)
    snap.save(7, {"model": sd}, global_extra={"config": {"model": {"n_heads": 8}}})
    snap.wait()
    snap.close()
    return sum(t.numel() * 4 for t in sd.values())


def test_tools_stream_a_checkpoint_larger_than_their_memory(tmp_path):
    nbytes = write_checkpoint(str(tmp_path / "big"))
    assert nbytes > 200e6
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "big"), str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["rcs"] == [0, 0], p.stderr[-3000:]
    grew = r["peak_mb"] - r["base_mb"]
    assert grew < LIMIT_MB < nbytes / 2**20, f"peak RSS grew {grew:.0f} MB for a {nbytes / 1e6:.0f} MB checkpoint"
    assert (tmp_path / "model.safetensors").stat().st_size > nbytes
