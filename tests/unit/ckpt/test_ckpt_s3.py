"""The tools on an S3 URL (moto's server on loopback, through s3fs): ls, verify, reshard S3 -> S3,
diff, convert to a local safetensors file, gc. Same code path as any fsspec URL."""

from __future__ import annotations

import json

import pytest
import torch

from resilient.snapshot import Snapshotter
from resilient_tools.cli import main

pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def s3(s3_endpoint):
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    g = torch.Generator().manual_seed(0)
    state = {"model": {"layers.0.attention.wq.weight": torch.randn(64, 64, generator=g),
                       "layers.0.attention.wo.weight": torch.randn(64, 64, generator=g).bfloat16(),
                       "norm.weight": torch.ones(64)}}
    with Snapshotter("s3://ckpt/run", storage_options=opts, chunk_bytes=4096, keep_last=5) as snap:
        for step in (1, 2):
            snap.save(step, state)
            snap.wait()
    yield json.dumps(opts)


def test_tools_on_s3(s3, tmp_path, capsys):
    so = ["-q", "--storage-options", s3]
    assert main([*so, "ls", "s3://ckpt/run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["complete"] for r in rows)
    assert main([*so, "verify", "s3://ckpt/run@1"]) == 0
    assert main([*so, "reshard", "s3://ckpt/run", "--to", "tp=2", "s3://ckpt/tp2"]) == 0
    assert main([*so, "verify", "s3://ckpt/tp2"]) == 0
    capsys.readouterr()
    assert main([*so, "diff", "s3://ckpt/run", "s3://ckpt/tp2"]) == 0
    assert "MATCH (bitwise)" in capsys.readouterr().out
    out = tmp_path / "m.safetensors"
    assert main([*so, "convert", "s3://ckpt/run@2", str(out), "--format", "safetensors"]) == 0
    from safetensors.torch import load_file
    assert load_file(str(out))["layers.0.attention.wo.weight"].dtype == torch.bfloat16
    assert main([*so, "gc", "s3://ckpt/run", "--keep-last", "1"]) == 0
    assert "removed: [1]" in capsys.readouterr().out
    assert main([*so, "inspect", "s3://ckpt/nothing-here"]) == 2
    assert "BadUrl" in capsys.readouterr().err
