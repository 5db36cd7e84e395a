"""Property: any writer layout's chunks, read by any reader layout, give back the tensor.

Layouts are simulated in one process: a mesh shape, placements, and every
mesh coordinate's shard computed by resilient's arithmetic, checked against
an independent oracle (``torch.chunk`` applied per sharded mesh dim, which is
DTensor's definition of ``Shard``)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.tensor import Replicate, Shard

from resilient.snapshot.boxes import Box, copy_overlap, is_primary_replica, shard_pieces, split_rows


def oracle_local(g: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...], placements) -> torch.Tensor:
    local = g
    for n, c, p in zip(mesh, coord, placements):
        if isinstance(p, Shard):
            parts = torch.chunk(local, n, dim=p.dim)
            local = parts[c] if c < len(parts) else local.narrow(p.dim, 0, 0)
    return local


@st.composite
def layouts(draw, ndim: int):
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = [draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, max(ndim - 1, 0)))))
                  if ndim else Replicate() for _ in mesh]
    return mesh, placements


@st.composite
def cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    return shape, draw(layouts(ndim)), draw(layouts(ndim)), draw(st.integers(1, 64))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_any_writer_layout_reads_back_in_any_reader_layout(case):
    shape, (wmesh, wpl), (rmesh, rpl), chunk_bytes = case
    g = torch.arange(max(1, int(torch.tensor(shape).prod())) if shape else 1, dtype=torch.int32)
    g = g[: int(torch.tensor(shape).prod())].reshape(shape) if shape else g.reshape(())

    # Writers: every primary replica stores its pieces, cut into chunks.
    stored: list[tuple[Box, torch.Tensor]] = []
    for coord in itertools.product(*(range(n) for n in wmesh)):
        local = oracle_local(g, wmesh, coord, wpl)
        pieces = shard_pieces(shape, wmesh, coord, wpl)
        assert sum(p.box.numel for p in pieces) == local.numel()
        for p in pieces:
            lb = Box((0,) * local.dim(), tuple(local.shape))
            data = local[p.local.slices_within(lb)]
            assert torch.equal(data, g[p.box.slices_within(Box((0,) * g.dim(), shape))])
            if is_primary_replica(coord, wpl):
                for row, sub in split_rows(p.box, 4, chunk_bytes):
                    stored.append((sub, data[sub.slices_within(p.box)].clone()))
    assert sum(b.numel for b, _ in stored) == g.numel()  # tiled exactly: no gap, no double write

    # Readers: every coordinate (replicas too) assembles its shard from the chunks.
    for coord in itertools.product(*(range(n) for n in rmesh)):
        want = oracle_local(g, rmesh, coord, rpl)
        got = torch.full_like(want, -1)
        lb = Box((0,) * want.dim(), tuple(want.shape))
        for p in shard_pieces(shape, rmesh, coord, rpl):
            out = torch.full(p.box.sizes, -1, dtype=g.dtype)
            n = sum(copy_overlap(b, t, p.box, out) for b, t in stored)
            assert n == p.box.numel
            got[p.local.slices_within(lb)] = out
        assert torch.equal(got, want)
