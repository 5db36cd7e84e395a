"""The tools on the runtime's optimizer naming: ``optim/<param>/<key>`` (train_state keeps only
``optim_sd["state"]``), as well as ``optim/state/<param>/<key>`` (a whole ``get_state_dict`` dict).

Reshard must shard the runtime's optimizer state like its parameter, and a torch-dcp round trip
must give back the same names.
"""

from __future__ import annotations

import json

import pytest
import torch

from resilient.snapshot import SnapshotReader
from resilient.snapshot.boxes import Box
from resilient_tools.cli import main
from resilient_tools.importer import _from_dcp_name
from resilient_tools.convert import _dcp_name
from resilient_tools.layouts import param_name


def runtime_state():
    """A tiny GPT after one AdamW step, as ``TrainState._build_state`` shapes it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from resilient.gpt.config import ModelConfig
    from resilient.gpt.model import GPT, cross_entropy

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=96, dim=64, n_layers=4, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 17))
    cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": dict(osd["state"])}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from resilient.snapshot import Snapshotter

    root = tmp_path_factory.mktemp("rt") / "run"
    with Snapshotter(str(root), every=1, chunk_bytes=4096, keep_last=5,
                     layout={"pp": 1, "dp": 1, "tp": 1, "world": 1}) as snap:
        snap.save(1, runtime_state(), force=True, global_extra={"config": {"model": {"n_heads": 4}}})
        snap.wait()
    names = SnapshotReader(str(root)).manifest().tensors
    assert "optim/layers.0.attention.wq.weight/exp_avg" in names  # the runtime's naming, not optim/state/...
    return root


def test_param_name_reads_both_namings():
    assert param_name("optim/layers.0.attention.wq.weight/exp_avg") == "layers.0.attention.wq.weight"
    assert param_name("optim/state/layers.0.attention.wq.weight/exp_avg") == "layers.0.attention.wq.weight"
    assert param_name("optim/output.weight/step") == "output.weight"
    assert param_name("model/norm.weight") == "norm.weight"
    assert param_name("optim/param_groups/0/lr") is None and param_name("other/x") is None
    for ours in ("optim/layers.0.w.weight/exp_avg", "optim/state/layers.0.w.weight/exp_avg_sq",
                 "model/layers.0.w.weight", "optim/param_groups/0/lr"):
        assert _from_dcp_name(_dcp_name(ours)) == ours


def test_reshard_shards_runtime_optimizer_state_like_its_parameter(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["-q", "reshard", str(ckpt), "--to", "dp=2,tp=2", str(out)]) == 0
    capsys.readouterr()
    assert main(["-q", "diff", str(ckpt), str(out)]) == 0 and "MATCH (bitwise)" in capsys.readouterr().out
    m = SnapshotReader(str(out)).manifest()
    checked = 0
    for name, rec in m.tensors.items():
        p = param_name(name)
        if not name.startswith("optim/") or not rec.shape:
            continue
        assert p is not None, name
        boxes = lambda r: sorted((c.offsets, c.sizes) for c in r.chunks)  # noqa: E731
        # exp_avg of wq (tp Shard(0) x dp _StridedShard) is cut into exactly the parameter's boxes
        assert boxes(rec) == boxes(m.tensors[f"model/{p}"]), name
        checked += 1
    assert checked == 2 * sum(n.startswith("model/") for n in m.tensors)  # exp_avg, exp_avg_sq of each
    wq = m.tensors["optim/layers.0.attention.wq.weight/exp_avg"]
    assert len(wq.chunks) == 4 and all(Box(c.offsets, c.sizes).numel == 64 * 64 // 4 for c in wq.chunks)


def test_resharded_runtime_version_restores_into_runtime_state(ckpt, tmp_path):
    from resilient.snapshot import Snapshotter

    out = tmp_path / "out"
    assert main(["-q", "reshard", str(ckpt), "--to", "dp=2", str(out)]) == 0
    state = runtime_state()
    want = {k: v.clone() for k, v in state["optim"]["output.weight"].items()}
    for v in state["optim"]["output.weight"].values():
        v.zero_()
    got = Snapshotter(str(out), every=0).restore(state)
    assert got is not None and got.step == 1
    assert all(torch.equal(state["optim"]["output.weight"][k], want[k]) for k in want)


def test_dcp_roundtrip_keeps_runtime_optimizer_names(ckpt, tmp_path, capsys):
    folder = tmp_path / "dcp"
    assert main(["-q", "convert", str(ckpt), str(folder), "--format", "torch-dcp", "--optimizer"]) == 0
    out = tmp_path / "back"
    assert main(["-q", "import", str(folder), str(out), "--from", "torch-dcp", "--step", "1"]) == 0
    src, back = SnapshotReader(str(ckpt)).manifest(), SnapshotReader(str(out)).manifest()
    assert set(back.tensors) == set(src.tensors)
    capsys.readouterr()
    assert main(["-q", "diff", str(ckpt), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["match"]
