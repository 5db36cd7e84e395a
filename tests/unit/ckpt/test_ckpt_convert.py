"""resilient ckpt convert / import: safetensors, torch DCP and torch.save, both ways, same tensors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from resilient.snapshot import SnapshotReader
from resilient_tools.cli import main

from test_ckpt_basic import train_and_snapshot


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "run"
    train_and_snapshot(str(root), steps=(3,))
    return root


@pytest.fixture(scope="module")
def tensors(ckpt):
    r = SnapshotReader(str(ckpt))
    m = r.manifest()
    return {n: r.read_region(m, n) for n in m.tensors}


def test_safetensors_loads_with_the_package(ckpt, tensors, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    assert main(["-q", "convert", str(ckpt), str(out), "--format", "safetensors", "--block-mb", "1"]) == 0
    got = load_file(str(out))
    want = {n[len("model/"):]: t for n, t in tensors.items() if n.startswith("model/")}
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["resilient_step"] == "3"
    out2 = tmp_path / "all.safetensors"
    assert main(["-q", "convert", f"{ckpt}@3", str(out2), "--format", "safetensors", "--optimizer"]) == 0
    got = load_file(str(out2))
    assert torch.equal(got["optim/state/output.weight/exp_avg"], tensors["optim/state/output.weight/exp_avg"])
    assert len(got) == len(tensors)


def test_torch_and_dcp_exports(ckpt, tensors, tmp_path):
    import torch.distributed.checkpoint as dcp

    pt = tmp_path / "model.pt"
    assert main(["-q", "convert", str(ckpt), str(pt), "--format", "torch"]) == 0
    sd = torch.load(pt, weights_only=True)
    assert all(torch.equal(sd[k], tensors[f"model/{k}"]) for k in sd) and len(sd) == 39

    folder = tmp_path / "dcp"
    assert main(["-q", "convert", str(ckpt), str(folder), "--format", "torch-dcp", "--optimizer"]) == 0
    assert not [p for p in folder.iterdir() if p.name.startswith(".staging")]
    state = {"model.layers.1.attention.wo.weight": torch.zeros(64, 64),
             "optim.state.layers.1.attention.wo.weight.exp_avg_sq": torch.zeros(64, 64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder))
    assert torch.equal(state["model.layers.1.attention.wo.weight"], tensors["model/layers.1.attention.wo.weight"])
    assert torch.equal(state["optim.state.layers.1.attention.wo.weight.exp_avg_sq"],
                       tensors["optim/state/layers.1.attention.wo.weight/exp_avg_sq"])


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "torch-dcp"])
def test_import_roundtrip(ckpt, tmp_path, capsys, fmt):
    exported = tmp_path / ("x.st" if fmt == "safetensors" else "x.pt" if fmt == "torch" else "xdcp")
    assert main(["-q", "convert", str(ckpt), str(exported), "--format", fmt, "--optimizer"]) == 0
    out = tmp_path / "imported"
    assert main(["-q", "import", str(exported), str(out), "--from", fmt, "--step", "3"]) == 0
    assert main(["-q", "verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["-q", "diff", str(ckpt), str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["match"] and len(r["tensors"]) == 156


class Payload:
    """Unpickling this would run code of the file's choosing: import must refuse it."""

    def __reduce__(self):
        return (print, ("unpickled!",))


def test_import_never_unpickles_objects(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    torch.save({"w": torch.ones(2), "obj": Payload()}, bad)
    rc = main(["-q", "import", str(bad), str(tmp_path / "o"), "--from", "torch"])
    err = capsys.readouterr().err
    assert rc == 2 and "ConvertError" in err and "never" in err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").rglob("manifest.json"))


def test_convert_refuses_existing_and_reports_missing(ckpt, tmp_path, capsys):
    rc = main(["-q", "import", str(tmp_path / "nope.st"), str(tmp_path / "o"), "--from", "safetensors"])
    assert rc == 2 and "BadUrl" in capsys.readouterr().err
    out = tmp_path / "r"
    assert main(["-q", "reshard", str(ckpt), "--to", "dp=2", str(out)]) == 0
    assert main(["-q", "reshard", str(ckpt), "--to", "dp=2", str(out)]) == 2
    assert "OutputExists" in capsys.readouterr().err
