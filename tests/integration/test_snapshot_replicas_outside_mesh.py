"""Copies of a DTensor that its own mesh does not know about are written once.

The GPT's (dp, tp) layout, in miniature, on 4 gloo ranks: TP (``ColwiseParallel``)
on a linear layer over the tp sub-mesh, then FSDP2 ``fully_shard`` over the dp
sub-mesh. The linear weight becomes a 2-D (dp, tp) DTensor with a strided shard;
the embedding, which TP leaves alone, a 1-D DTensor on the dp sub-mesh only, and
its copy on the tp peer sits in another dp sub-mesh where it is coordinate 0 too.
Before the fix every tp rank wrote the same embedding rows and each durable
commit was refused (``chunks of 'model/tok_embeddings.weight' overlap``: the
(pp=2, dp=2, tp=2) GPT never had a restorable version). Now each tensor's chunks
tile it exactly once, and the version restores bitwise into one process and into
another layout (FSDP2 over all 4 ranks, no TP)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow

VOCAB, DIM = 10, 8  # 10 rows: uneven FSDP2 shards of the embedding over dp=2 are 5+5; of 4 ranks, 3+3+3+1


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    from collections import OrderedDict
    return torch.nn.Sequential(OrderedDict(emb=torch.nn.Embedding(VOCAB, DIM), proj=torch.nn.Linear(DIM, 12)))


def full_values(state: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def write_dp2_tp2_then_restore_dp4(rank: int, world: int, url: str) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from resilient.snapshot import Snapshotter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tiny_model()
    parallelize_module(model, mesh["tp"], {"proj": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    state = {"model": model.state_dict()}
    placements = {k: (tuple(v.device_mesh.shape), str(v.placements)) for k, v in state["model"].items()}
    assert placements["emb.weight"] == ((2,), "(Shard(dim=0),)"), placements  # the layout under test
    assert "_StridedShard" in placements["proj.weight"][1], placements
    with Snapshotter(url, layout={"dp": 2, "tp": 2}, chunk_bytes=64) as snap:
        snap.save(1, state, force=True)
        assert snap.wait(timedelta(seconds=60))
        dist.barrier()  # every rank's upload is done before rank 0's committer is drained
        assert snap.wait(timedelta(seconds=60))
        assert rank != 0 or snap.committed_step == 1, "the commit was refused (see the warning above)"
    # Another layout in the same processes: FSDP2 over all 4 ranks, no TP, zeroed first.
    other = tiny_model()
    fully_shard(other, mesh=init_device_mesh("cpu", (4,)))
    target = {"model": other.state_dict()}
    for v in target["model"].values():
        v.to_local().detach().zero_()
    with Snapshotter(url, layout={"dp": 4}) as reader:
        got = reader.restore(target)
    assert got is not None and got.step == 1 and got.resharded
    return full_values(target["model"])


@pytest.fixture(scope="module")
def pool():
    with GlooPool(4, timeout=timedelta(seconds=120), collective_timeout=timedelta(seconds=60)) as p:
        yield p


def test_replicas_outside_a_dtensors_mesh_are_written_once(pool, tmp_path):
    url = f"file://{tmp_path}/ck"
    resharded = pool.run(write_dp2_tp2_then_restore_dp4, url)
    want = full_values(tiny_model().state_dict())
    for rank, values in enumerate(resharded):
        for name, w in want.items():
            assert torch.equal(values[name], w), (rank, name)

    from resilient.snapshot import SnapshotReader, Snapshotter
    reader = SnapshotReader(url)
    m = reader.manifest()  # parsing refuses overlapping chunks
    for name, t in m.tensors.items():
        assert sum(torch.Size(c.sizes).numel() for c in t.chunks) == t.numel, name  # tiled exactly once
    writers = {c.object.split("/")[1][:6] for c in m.tensors["model/emb.weight"].chunks}
    assert writers == {"r00000", "r00002"}, writers  # dp 0 and dp 1 of tp 0; their tp peers skip

    single = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    with Snapshotter(url) as one:  # one process, plain tensors
        assert one.restore(single).step == 1
    for name, w in want.items():
        assert torch.equal(single["model"][name], w), name
