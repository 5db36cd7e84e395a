"""Checkpoints written by 2 real gloo processes (FSDP2 dp=2, and tensor parallel tp=2) through the
worker's own parallel stack (``resilient.gpt.parallel.build_model``): the tools read them, reshard them
bitwise, and ``layouts.rank_boxes`` predicts exactly the boxes each rank wrote (keeps layouts.py in
step with parallel.py).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spawnutil import exit_passed

from resilient.snapshot import SnapshotReader
from resilient.snapshot.boxes import Box
from resilient_tools.cli import main
from resilient_tools.layouts import Target, model_shape, param_name, rank_boxes

pytestmark = pytest.mark.slow

MODEL = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 96, "max_seq_len": 16}


def worker(rank: int, world: int, store: str, url: str, tp: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from resilient.gpt.config import config_from_dict
    from resilient.gpt.model import cross_entropy
    from resilient.gpt.parallel import build_layout, build_model
    from resilient.snapshot import Snapshotter

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        cfg = config_from_dict({"model": MODEL, "parallel": {"pp": 1, "tp": tp},
                                "train": {"seq_len": 16, "global_batch": 4}})
        layout = build_layout(cfg, "cpu")
        pm = build_model(cfg, layout, torch.device("cpu"), torch.float32)
        model = pm.parts[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 96, (4, 17), generator=g)
        cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        snap = Snapshotter(url, every=1, layout=layout.as_dict(), chunk_bytes=2048)
        snap.save(1, {"model": msd, "optim": osd}, global_extra={"config": {"model": MODEL}})
        snap.wait()
        snap.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_passed()


def write(tmp_path, name: str, tp: int) -> str:
    url = str(tmp_path / name)
    mp.start_processes(worker, args=(2, str(tmp_path / f"store-{name}"), url, tp), nprocs=2, join=True,
                       start_method="spawn")
    return url


def written_boxes_match_layout(url: str, target: Target) -> None:
    r = SnapshotReader(url)
    m = r.manifest()
    shape = model_shape(m)
    for name, rec in m.tensors.items():
        p = param_name(name)
        owner = m.tensors.get(f"model/{p}") if p else None
        mine = [b for _, b, prim in rank_boxes(name, rec.shape, target, shape, owner.shape if owner else None) if prim]
        for c in rec.chunks:
            cb = Box(c.offsets, c.sizes)
            assert any(cb.intersect(b) == cb for b in mine), (name, cb, mine)


def test_two_process_checkpoints(tmp_path, capsys):
    dp_url = write(tmp_path, "dp2", tp=1)
    tp_url = write(tmp_path, "tp2", tp=2)
    for url, target in ((dp_url, Target(dp=2)), (tp_url, Target(tp=2))):
        assert main(["-q", "verify", url]) == 0
        capsys.readouterr()
        assert main(["-q", "inspect", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["layout"]["world"] == 2
        m = SnapshotReader(url).manifest()
        assert m.world == 2 and m.layout["dp"] * m.layout["tp"] == 2
        written_boxes_match_layout(url, target)
        for to in ("dp=3", "pp=2,tp=2"):
            out = str(tmp_path / f"{os.path.basename(url)}-{to.replace(',', '_').replace('=', '')}")
            assert main(["-q", "reshard", url, "--to", to, out]) == 0
            assert main(["-q", "diff", url, out]) == 0
    capsys.readouterr()
    # the same model under two layouts: same parameters up to float reassociation
    assert main(["-q", "diff", dp_url, tp_url, "--atol", "1e-5", "--rtol", "1e-4"]) == 0
