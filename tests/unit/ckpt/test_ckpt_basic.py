"""resilient ckpt ls / inspect / verify / gc and the typed errors, on checkpoints from real training steps.

The checkpoints are written by the real ``Snapshotter`` after real AdamW steps
of the GPT (small chunks, so tensors span several chunks and objects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient_tools.cli import main

CKPT_ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def train_and_snapshot(url: str, steps=(2, 4), chunk_bytes: int = 4096, part_bytes: int = 1 << 20) -> None:
    """A few real training steps of a tiny GPT, snapshotted at ``steps`` with the model config in extra."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from resilient.gpt.config import ModelConfig
    from resilient.gpt.model import GPT, cross_entropy
    from resilient.snapshot import Snapshotter

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=4, n_heads=4)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snap = Snapshotter(url, every=1, chunk_bytes=chunk_bytes, part_bytes=part_bytes, keep_last=100,
                       layout={"pp": 1, "dp": 1, "tp": 1, "world": 1}, config_digest="digest-tiny")
    for step in range(1, max(steps) + 1):
        x = torch.randint(0, 96, (2, 17))
        loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in steps:
            msd, osd = get_state_dict(model, opt)
            snap.save(step, {"model": msd, "optim": osd}, force=True,
                      global_extra={"config": {"model": {"n_heads": 4, "dim": 64}}, "sample": step * 2})
            snap.wait()
    snap.close()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "run"
    train_and_snapshot(str(root))
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["-q", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls(ckpt, capsys, tmp_path):
    rc, out, _ = run(capsys, "ls", ckpt, "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["step"] for r in rows] == [2, 4]
    assert all(r["complete"] and r["layout"]["dp"] == 1 and r["bytes"] > 0 and r["tensors"] > 0 for r in rows)
    rc, out, _ = run(capsys, "ls", f"file://{ckpt}")
    assert rc == 0 and "complete" in out and "pp=1" in out


def test_inspect_json_and_tree(ckpt, capsys):
    rc, out, _ = run(capsys, "inspect", f"{ckpt}@2", "--json")
    d = json.loads(out)
    assert rc == 0 and d["step"] == 2 and d["config_digest"] == "digest-tiny"
    assert d["extra"]["sample"] == 4
    wq = d["tensors"]["model/layers.0.attention.wq.weight"]
    assert wq["shape"] == [64, 64] and wq["dtype"] == "float32" and wq["bytes"] == 64 * 64 * 4
    assert wq["chunks"] == 4  # 16 KiB cut into 4 KiB chunks
    assert "optim/state/layers.0.attention.wq.weight/exp_avg" in d["tensors"]
    rc, out, _ = run(capsys, "inspect", ckpt)  # newest by default
    assert rc == 0 and "step 4" in out and "layers.3.feed_forward.w2.weight" in out and "optim/" in out


def test_verify_sound_and_fast(ckpt, capsys):
    assert run(capsys, "verify", ckpt)[0] == 0
    rc, out, _ = run(capsys, "verify", f"{ckpt}@2", "--fast", "--json")
    assert rc == 0 and json.loads(out)["ok"]


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_verify_flipped_byte_names_object(ckpt, capsys, tmp_path):
    bad = _copy(ckpt, tmp_path / "bad")
    m = json.loads((bad / "step-000000000004" / "manifest.json").read_text())
    chunk = m["tensors"]["model/layers.2.feed_forward.w1.weight"]["chunks"][1]
    obj = bad / "step-000000000004" / chunk["object"]
    data = bytearray(obj.read_bytes())
    data[chunk["offset"] + 5] ^= 0x10
    obj.write_bytes(bytes(data))
    assert run(capsys, "verify", bad, "--fast")[0] == 0  # structure is intact
    rc, out, _ = run(capsys, "verify", bad, "--json")
    r = json.loads(out)
    assert rc == 1 and not r["ok"]
    assert r["bad_objects"] == [str(obj).replace(os.sep, "/")] or r["bad_objects"][0].endswith(chunk["object"])
    assert any(p["tensor"] == "model/layers.2.feed_forward.w1.weight" and "checksum" in p["problem"]
               for p in r["problems"])
    rc, out, _ = run(capsys, "verify", bad)
    assert rc == 1 and chunk["object"] in out and "BAD" in out


def test_verify_missing_and_truncated_objects(ckpt, capsys, tmp_path):
    bad = _copy(ckpt, tmp_path / "bad")
    vdir = bad / "step-000000000004"
    objs = sorted(p for p in vdir.rglob("*.bin"))
    assert len(objs) >= 2
    objs[0].unlink()
    objs[1].write_bytes(objs[1].read_bytes()[:100])
    rc, out, _ = run(capsys, "verify", bad, "--fast", "--json")
    r = json.loads(out)
    assert rc == 1
    probs = {Path(p["object"]).name: p["problem"] for p in r["problems"]}
    assert probs[objs[0].name] == "object is missing" and "truncated" in probs[objs[1].name]
    rc, out, _ = run(capsys, "verify", bad)
    assert rc == 1 and objs[0].name in out and objs[1].name in out


def test_gc_keeps_newest_and_removes_debris(ckpt, capsys, tmp_path):
    root = _copy(ckpt, tmp_path / "gc")
    debris = root / "step-000000000003" / "abc"
    debris.mkdir(parents=True)
    (debris / "r00000-p0000.bin").write_bytes(b"x" * 10)
    rc, out, _ = run(capsys, "gc", root, "--keep-last", "1", "--dry-run")
    assert rc == 0 and "would remove: [2, 3]" in out and (root / "step-000000000002").exists()
    rc, out, _ = run(capsys, "gc", root, "--keep-last", "1", "--keep-every", "4")
    assert rc == 0 and "removed: [2, 3]" in out
    assert sorted(p.name for p in root.iterdir()) == ["step-000000000004"]
    rc, out, _ = run(capsys, "gc", root, "--keep-last", "1")  # the only complete version is never deleted
    assert rc == 0 and "removed: nothing" in out and (root / "step-000000000004" / "manifest.json").exists()


def test_errors_are_typed_and_say_what_to_do(ckpt, capsys, tmp_path):
    rc, _, err = run(capsys, "inspect", tmp_path / "nowhere")
    assert rc == 2 and "BadUrl" in err and "no such checkpoint directory" in err
    rc, _, err = run(capsys, "inspect", f"{ckpt}@15")
    assert rc == 2 and "NoSnapshotFound" in err and "[2, 4]" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = run(capsys, "verify", tmp_path / "empty")  # nothing to judge: an error, not a verdict
    assert rc == 2 and "NoSnapshotFound" in err and "no snapshot versions" in err
    root = _copy(ckpt, tmp_path / "m")
    man = root / "step-000000000004" / "manifest.json"
    text = man.read_text()
    man.write_text(text[: len(text) // 2])
    rc, _, err = run(capsys, "inspect", root)
    assert rc == 2 and "SnapshotCorrupt" in err and "manifest.json" in err
    rc, out, _ = run(capsys, "verify", root)
    assert rc == 1 and "manifest.json" in out
    man.write_text(text.replace('"format_version":1', '"format_version":99'))
    rc, _, err = run(capsys, "inspect", root)
    assert rc == 2 and "FormatVersionError" in err and "upgrade" in err
    rc, _, err = run(capsys, "reshard", ckpt, "--to", "tp=3", tmp_path / "o")
    assert rc == 2 and "LayoutError" in err and "heads (4)" in err
    rc, _, err = run(capsys, "reshard", ckpt, "--to", "pp=3", tmp_path / "o")
    assert rc == 2 and "LayoutError" in err and "4 layers" in err
    rc, _, err = run(capsys, "reshard", ckpt, "--to", "pp=two", tmp_path / "o")
    assert rc == 2 and "LayoutError" in err
    assert not (tmp_path / "o").exists()


def test_module_entry_point():
    """``python -m resilient_tools.cli`` works, and ``--help`` stays cheap (torch is imported lazily)."""
    p = subprocess.run([sys.executable, "-m", "resilient_tools.cli", "convert", "--help"],
                       capture_output=True, text=True, env=CKPT_ENV, timeout=60)
    assert p.returncode == 0 and "NEEDS RAM FOR THE WHOLE SELECTION" in " ".join(p.stdout.split())
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, resilient_tools.cli; print(' '.join(sys.modules))"],
        capture_output=True, text=True, env=CKPT_ENV, timeout=60).stdout.split()
