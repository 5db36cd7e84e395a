"""Real processes (gloo, DeviceMesh, DTensor): write with one layout, read with another, bitwise.

4 processes write on a (dp=2, tp=2) mesh with uneven Shard(0)/Shard(1),
Replicate, a strided shard (FSDP2 over TP on the same dim), replicated plain
tensors and pipeline-stage-like plain tensors; the same 4 read on a 1-D mesh
with other placements, then 2 processes read with yet another layout.
Process groups rendezvous through a FileStore: no ports at all.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from spawnutil import exit_passed

pytestmark = pytest.mark.slow

SHAPES = {"w": (11, 7), "v": (9,), "r": (3, 4), "s": (12, 4)}  # strided shards must be even


def global_tensor(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def build_state(mesh, placements: dict, rank: int) -> dict:
    model = {n: distribute_tensor(global_tensor(n), mesh, p) for n, p in placements.items()}
    model["plain"] = torch.arange(5.0)
    stage = rank // 2  # like a pipeline stage: only some ranks hold these names
    return {"model": model, f"stage{stage}": {"x": torch.full((3,), float(stage))},
            "meta": {"lr": 0.5}}


def zero_state(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = zero_state(v) if isinstance(v, dict) else (v.detach().clone().zero_() if isinstance(v, torch.Tensor) else None)
    return out


def check(state: dict, rank: int) -> None:
    for n, t in state["model"].items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        want = torch.arange(5.0) if n == "plain" else global_tensor(n)
        assert torch.equal(full, want), (rank, n)
    stage = rank // 2
    assert torch.equal(state[f"stage{stage}"]["x"], torch.full((3,), float(stage)))
    assert state["meta"]["lr"] == 0.5


def worker(rank: int, world: int, store: str, url: str, phase: str) -> None:
    from resilient.snapshot import Snapshotter
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        if phase == "write4":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            pl = {"w": [Shard(0), Shard(1)], "v": [Shard(0), Replicate()], "r": [Replicate(), Replicate()],
                  "s": [_StridedShard(0, split_factor=2), Shard(0)]}
            state = build_state(mesh, pl, rank)
            snap = Snapshotter(url, layout={"dp": 2, "tp": 2}, chunk_bytes=24)
            snap.save(7, state, extra={"rank": rank}, global_extra={"sample": 70})
            assert snap.wait(timedelta(seconds=60))
            snap.close()
            dist.barrier()
            # Same processes, other layout: a 1-D mesh of 4.
            mesh1 = init_device_mesh("cpu", (4,))
            pl1 = {"w": [Shard(1)], "v": [Replicate()], "r": [Shard(0)], "s": [Shard(1)]}
            target = zero_state(build_state(mesh1, pl1, rank))
            with Snapshotter(url, layout={"dp": 4}) as reader:  # closed: no writer threads left at exit
                got = reader.restore(target)
            assert got.step == 7 and got.extra == {"rank": rank} and got.global_extra == {"sample": 70}
            assert got.resharded
            check(target, rank)
        else:  # read2: two processes, (dp=1, tp=2) with Shard(0) everywhere
            mesh = init_device_mesh("cpu", (1, 2))
            pl = {"w": [Replicate(), Shard(0)], "v": [Shard(0), Shard(0)], "r": [Replicate(), Shard(1)],
                  "s": [Shard(1), Shard(0)]}
            target = zero_state(build_state(mesh, pl, rank))
            with Snapshotter(url) as reader:  # closed: no writer threads left at exit
                got = reader.restore(target)
            assert got.step == 7 and got.world == 4 and got.rank_extras[3] == {"rank": 3}
            check(target, rank)
        # No rank tears its connections down while another is still in check()'s collectives.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_passed()


def lagging_worker(rank: int, world: int, store: str, root: str, _phase: str) -> None:
    """Rank 1's storage is slow, so it coalesces versions rank 0 wrote: those never commit,
    and every version that does commit is whole on both ranks."""
    from resilient_chaos.faultyfs import FaultPlan
    from resilient.snapshot import Snapshotter
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2,))
        w = distribute_tensor(torch.zeros(9, 5), mesh, [Shard(0)])
        if rank == 1:
            snap = Snapshotter(f"faulty::file://{root}", keep_last=100, storage_options={
                "faulty": {"plan": FaultPlan(latency=timedelta(milliseconds=40))}})
        else:
            snap = Snapshotter(f"file://{root}", keep_last=100, commit_timeout=timedelta(seconds=20))
        for step in range(1, 13):
            w.to_local().fill_(step)
            snap.save(step, {"w": w})
        assert snap.wait(timedelta(seconds=60))
        dist.barrier()  # both ranks' uploads are done before rank 0's committer is drained
        assert snap.wait(timedelta(seconds=60))
        if rank == 0:
            assert snap.committed_step == 12
        snap.close()
    finally:
        dist.destroy_process_group()
    exit_passed()


def test_ranks_that_coalesce_differently_commit_only_whole_versions(tmp_path):
    store = tmp_path / "store-lag"
    root = tmp_path / "ck"
    mp.start_processes(lagging_worker, args=(2, str(store), str(root), ""), nprocs=2, start_method="spawn")
    from resilient.snapshot import SnapshotReader
    r = SnapshotReader(f"file://{root}")
    steps = r.complete_steps()
    assert steps[-1] == 12 and len(steps) < 12  # some versions were skipped on rank 1
    for step in steps:
        assert (r.read_region(r.manifest(step), "w") == step).all()


def run(world: int, tmp_path, url: str, phase: str) -> None:
    store = tmp_path / f"store-{phase}"
    mp.start_processes(worker, args=(world, str(store), url, phase), nprocs=world, start_method="spawn")  # not fork: the test process has threads (servers, leases)


def test_write_dp2_tp2_read_other_layouts(tmp_path):
    url = f"file://{tmp_path}/ck"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(4, tmp_path, url, "write4")
    from resilient.snapshot import SnapshotReader
    m = SnapshotReader(url).manifest()
    assert m.world == 4 and m.layout == {"dp": 2, "tp": 2}
    # Replicas were written once: plain tensors by rank 0 only, stage names by their lowest rank.
    assert {c.object.split("/")[1][:6] for c in m.tensors["model/plain"].chunks} == {"r00000"}
    assert {c.object.split("/")[1][:6] for c in m.tensors["stage1/x"].chunks} == {"r00002"}
    assert sum(c.sizes[0] for c in m.tensors["model/r"].chunks) == 3
    run(2, tmp_path, url, "read2")
