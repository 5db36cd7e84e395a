"""layouts.py against the real thing: on a 4-process (dp=2, tp=2) mesh built by
``resilient.gpt.parallel.build_model`` (TP, then FSDP2: strided shards), every parameter's
local boxes on every rank are exactly what ``layouts.rank_boxes`` predicts."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spawnutil import exit_passed

pytestmark = pytest.mark.slow

MODEL = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 96, "max_seq_len": 16}


def worker(rank: int, world: int, store: str, result: str) -> None:
    from resilient.gpt.config import config_from_dict
    from resilient.gpt.parallel import build_layout, build_model
    from resilient.snapshot.boxes import local_pieces
    from resilient_tools.layouts import ModelShape, Target, rank_boxes

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        cfg = config_from_dict({"model": MODEL, "parallel": {"pp": 1, "tp": 2},
                                "train": {"seq_len": 16, "global_batch": 4}})
        pm = build_model(cfg, build_layout(cfg, "cpu"), torch.device("cpu"), torch.float32)
        target, shape = Target(pp=1, dp=2, tp=2), ModelShape(2, 64, 96, 96, 4)
        bad = []
        for name, p in pm.parts[0].named_parameters():
            gshape, pieces, _ = local_pieces(p)
            want = sorted((b.offsets, b.sizes) for r, b, _ in rank_boxes(f"model/{name}", gshape, target, shape)
                          if r == rank)
            got = sorted((pc.box.offsets, pc.box.sizes) for pc in pieces)
            if want != got:
                bad.append(f"{name} {p.placements}: real {got}, layouts.py {want}")
        with open(f"{result}.{rank}", "w") as f:
            f.write("\n".join(bad))
    finally:
        dist.destroy_process_group()
    exit_passed()


def test_layout_boxes_match_fsdp2_over_tp(tmp_path):
    result = str(tmp_path / "result")
    mp.start_processes(worker, args=(4, str(tmp_path / "store"), result), nprocs=4, join=True, start_method="spawn")
    for rank in range(4):
        mismatches = open(f"{result}.{rank}").read()
        assert not mismatches, f"rank {rank}:\n{mismatches}"
