"""resilient ckpt reshard and diff: any layout in, the target's boxes out, bitwise the same numbers.

The output must be an ordinary version: read back through ``SnapshotReader``
and through the normal restore path (``Snapshotter.restore``).
"""

from __future__ import annotations

import math

import pytest
import torch

from resilient.snapshot import SnapshotReader
from resilient.snapshot.boxes import Box
from resilient_tools.cli import main
from resilient_tools.layouts import ModelShape, Target, model_shape, parse_target, rank_boxes

from test_ckpt_basic import train_and_snapshot


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    train_and_snapshot(str(root), steps=(5,))
    return root


def read_all(url: str) -> dict[str, torch.Tensor]:
    r = SnapshotReader(url)
    m = r.manifest()
    return {n: r.read_region(m, n) for n in m.tensors}


@pytest.mark.parametrize("to", ["pp=2,dp=3,tp=2", "dp=4", "tp=4", "pp=4,tp=2"])
def test_reshard_roundtrip_bitwise(ckpt, tmp_path, capsys, to):
    out = tmp_path / "out"
    assert main(["-q", "reshard", f"{ckpt}@5", "--to", to, str(out), "--chunk-mb", "1"]) == 0
    capsys.readouterr()
    assert main(["-q", "diff", str(ckpt), str(out)]) == 0
    assert "MATCH (bitwise)" in capsys.readouterr().out
    assert main(["-q", "verify", str(out)]) == 0
    src, dst = read_all(str(ckpt)), read_all(str(out))
    assert src.keys() == dst.keys()
    for n in src:
        assert src[n].dtype == dst[n].dtype and torch.equal(src[n].view(-1).view(torch.uint8),
                                                            dst[n].view(-1).view(torch.uint8)), n
    m_src, m = SnapshotReader(str(ckpt)).manifest(), SnapshotReader(str(out)).manifest()
    target = parse_target(to)
    assert m.layout == target.as_dict() and m.world == target.world and m.step == 5
    assert m.values == m_src.values and m.extra == m_src.extra and m.config_digest == m_src.config_digest
    # every chunk lies inside one target rank's box: each target rank reads only its own bytes
    shape = model_shape(m)
    for name, rec in m.tensors.items():
        p = name.split("/", 2)[-1].rsplit("/", 1)[0] if name.startswith("optim/") else None
        pshape = m.tensors[f"model/{p}"].shape if p else None
        boxes = [b for _, b, prim in rank_boxes(name, rec.shape, target, shape, pshape) if prim]
        for c in rec.chunks:
            cb = Box(c.offsets, c.sizes)
            assert any(cb.intersect(b) == cb for b in boxes), (name, cb)


def test_resharded_version_restores_through_snapshotter(ckpt, tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from resilient.gpt.config import ModelConfig
    from resilient.gpt.model import GPT
    from resilient.snapshot import Snapshotter

    out = tmp_path / "out"
    assert main(["-q", "reshard", str(ckpt), "--to", "dp=2,tp=2", str(out)]) == 0
    model = GPT(ModelConfig(vocab_size=96, dim=64, n_layers=4, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()  # materialize optimizer state to restore into
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    got = Snapshotter(str(out), every=0, config_digest="digest-tiny").restore(state)
    assert got is not None and got.step == 5 and got.layout["tp"] == 2
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    want = read_all(str(ckpt))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model/{k}"]), k


def write_perturbed(src: str, out: str) -> None:
    """A copy of ``src`` with every float tensor nudged by < 1e-3 (the ``step`` counters by +1), via the tools' writer."""
    from resilient_tools.writer import VersionWriter
    r = SnapshotReader(src)
    m = r.manifest()
    w = VersionWriter(out, m.step, values=m.values)
    g = torch.Generator().manual_seed(3)
    for name in m.tensors:
        t = r.read_region(m, name)
        t = t + 1 if name.endswith("/step") else t + (torch.rand(t.shape, generator=g) * 1e-3 + 1e-6)
        w.add_tensor(name, tuple(t.shape), t.dtype)
        w.write(name, Box((0,) * t.dim(), tuple(t.shape)), t)
    w.commit()


def test_diff_reports_differences_and_tolerance(ckpt, tmp_path, capsys):
    import json
    import shutil
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    write_perturbed(str(ckpt), str(tmp_path / "b"))  # small noise everywhere, optimizer steps +1
    assert main(["-q", "diff", str(ckpt), str(tmp_path / "b"), "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert not r["match"]
    wq = next(t for t in r["tensors"] if t["name"] == "model/layers.0.attention.wq.weight")
    assert wq["status"] == "differ" and 0 < wq["max_abs"] < 2e-3 and wq["mismatched"] == 64 * 64
    assert main(["-q", "diff", str(ckpt), str(tmp_path / "b"), "--atol", "0.5"]) == 1  # optimizer steps 5 vs 6
    assert main(["-q", "diff", str(ckpt), str(tmp_path / "b"), "--atol", "1.5", "--rtol", "0"]) == 0
    assert "MATCH (within tolerance)" in capsys.readouterr().out
    capsys.readouterr()
    assert main(["-q", "diff", str(ckpt), str(other)]) == 0


def test_layout_boxes_tile_every_tensor():
    """For many targets, the primary boxes tile each GPT tensor exactly once; ranks match the mesh order."""
    shape = ModelShape(n_layers=4, dim=64, hidden=96, vocab=100, n_heads=4)
    names = {"model/tok_embeddings.weight": (100, 64), "model/layers.1.attention.wq.weight": (64, 64),
             "model/layers.2.attention.wo.weight": (64, 64), "model/layers.3.feed_forward.w2.weight": (64, 96),
             "model/layers.0.feed_forward.w1.weight": (96, 64), "model/norm.weight": (64,),
             "model/output.weight": (100, 64)}
    for pp in (1, 2, 4):
        for dp in (1, 2, 3, 5):
            for tp in (1, 2, 4):
                t = Target(pp, dp, tp)
                for name, s in names.items():
                    got = list(rank_boxes(name, s, t, shape))
                    prim = [b for _, b, p in got if p]
                    assert sum(b.numel for b in prim) == math.prod(s), (t, name)
                    assert all(a.intersect(b) is None for i, a in enumerate(prim) for b in prim[i + 1:]), (t, name)
                    ranks = {r for r, _, _ in got}
                    stage = {"model/tok_embeddings.weight": 0, "model/layers.1.attention.wq.weight": 1,
                             "model/layers.2.attention.wo.weight": 2, "model/layers.3.feed_forward.w2.weight": 3,
                             "model/layers.0.feed_forward.w1.weight": 0}.get(name, 3) // (4 // pp)
                    assert ranks <= set(range(stage * dp * tp, (stage + 1) * dp * tp)), (t, name, ranks)
