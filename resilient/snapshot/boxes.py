"""Resharding arithmetic: boxes of global tensors, who holds which, overlaps.

A *box* is a rectangular region of a global tensor (offsets + sizes per dim).
Writers store boxes; a reader wants the box(es) of its current shard and
copies the intersection with every stored box that overlaps it. Layout
changes (dp 4 -> 3, tp on another dim, a pipeline re-split) are nothing but
different boxes, so one piece of code does every reshard.

A DTensor's local shard is computed with torch's own placement arithmetic
(``_get_shard_size_and_offsets``, what ``compute_local_shape_and_global_offset``
uses), so uneven FSDP2 shards (``torch.chunk`` sizes), TP ``Shard(0/1)``, both
on a 2-D mesh, and ``_StridedShard`` (FSDP2 over TP on the same dim, whose
local rows are not contiguous globally) all come out right: the local shard
is cut into *pieces*, each a run of consecutive global indices per dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Sequence

import torch

from resilient.snapshot.api import SnapshotError

# torch.distributed.tensor is imported where a placement is read (the functions below), not
# with this module: the agent's node store and restore planning use the boxes' geometry alone,
# and importing the DTensor package cost each agent ~1.2 s of CPU at its start (-X importtime).


@dataclass(frozen=True)
class Box:
    """``sizes`` elements starting at ``offsets`` of a global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices_within(self, outer: "Box") -> tuple[slice, ...]:
        """Slices selecting this box inside a tensor that holds ``outer``."""
        return tuple(slice(o - p, o - p + s) for o, p, s in zip(self.offsets, outer.offsets, self.sizes))


@dataclass(frozen=True)
class Piece:
    """A part of a rank's local tensor that is one global box.

    ``local`` is where it sits in the local tensor, ``box`` where in the global one."""

    local: Box
    box: Box


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of maximal runs of consecutive global indices."""
    runs: list[tuple[int, int, int]] = []
    for i, g in enumerate(index):
        if runs and runs[-1][1] + runs[-1][2] == g and runs[-1][0] + runs[-1][2] == i:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, g, 1))
    return runs


def shard_pieces(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                 placements: Sequence) -> list[Piece]:
    """The pieces of the shard held at mesh coordinate ``coord``.

    Pure arithmetic (no process group), so tests can simulate any layout."""
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = list(global_shape)
    index: dict[int, torch.Tensor] = {}
    # A dim split once by a plain Shard holds one contiguous range: (global offset, size), in
    # closed form. Why: torch's index is a tensor of the dim's length, and its runs were found
    # in a Python list: a checkpoint claiming a 2 GiB tensor took ckpt reshard to 14 GB of RSS
    # before a byte was read. A dim split again falls back to the index.
    ranges: dict[int, tuple[int, int]] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise SnapshotError(
                "a DTensor with a Partial placement holds unreduced values; redistribute it to "
                "Shard/Replicate before snapshotting")
        if not isinstance(p, (Shard, _StridedShard)):  # Replicate
            continue
        if type(p) is Shard and p.dim not in index and p.dim not in ranges:
            size, offset = Shard.local_shard_size_and_offset(shape[p.dim], mesh_shape[mesh_dim], coord[mesh_dim])
            shape[p.dim], ranges[p.dim] = size, (offset, size)
            continue
        if p.dim in ranges:
            offset, size = ranges.pop(p.dim)
            index[p.dim] = torch.arange(offset, offset + size)
        size, idx = _get_shard_size_and_offsets(
            shape[p.dim], mesh_shape[mesh_dim], coord[mesh_dim], p, index.get(p.dim),
            global_shape[p.dim], False)
        shape[p.dim] = size
        index[p.dim] = idx if size > 0 else torch.empty(0, dtype=torch.long)
    if any(s == 0 for s in shape):
        return []
    per_dim = []
    for d, n in enumerate(global_shape):
        if d in ranges:
            per_dim.append([(0, ranges[d][0], ranges[d][1])])
        elif d in index:
            per_dim.append(_runs([int(v) for v in index[d].tolist()]))
        else:
            per_dim.append([(0, 0, n)])
    pieces = []
    for combo in product(*per_dim):
        pieces.append(Piece(Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo)),
                            Box(tuple(r[1] for r in combo), tuple(r[2] for r in combo))))
    return pieces


def is_primary_replica(coord: Sequence[int], placements: Sequence) -> bool:
    """Whether this coordinate writes its shard: the first among replicas.

    Replicas of a shard differ only in mesh dims where the placement is
    ``Replicate``; the one with coordinate 0 on all of them writes."""
    from torch.distributed.tensor import Replicate

    return all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))


def local_pieces(t: torch.Tensor) -> tuple[tuple[int, ...], list[Piece], bool]:
    """(global shape, pieces of this rank's local tensor, whether this rank writes it).

    A plain tensor is one full piece; whether a rank writes a plain tensor is
    decided by the caller (the lowest rank that holds its name)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:  # this rank is not part of the tensor's mesh
            return tuple(t.shape), [], False
        pieces = shard_pieces(tuple(t.shape), tuple(mesh.shape), coord, t.placements)
        return tuple(t.shape), pieces, is_primary_replica(coord, t.placements)
    full = Box((0,) * t.dim(), tuple(t.shape))
    return tuple(t.shape), ([Piece(full, full)] if t.numel() > 0 or t.dim() == 0 else []), True


def replica_claims(tensors: dict[str, torch.Tensor], value_names: Sequence[str], world: int) -> dict[str, tuple]:
    """What this rank would write of every entry another rank may hold a copy of:
    ``name -> ((offsets, sizes), ...)`` of its boxes, ``()`` for a plain tensor or a
    JSON value (written whole). Ranks exchange these once per state structure and
    :func:`replicas_left_to_others` picks one writer per copy.

    Why not the DTensor's own placements alone: a DTensor knows its replicas only
    along its own mesh. FSDP2 on a dp sub-mesh gives the parameters tensor parallel
    leaves alone (embeddings, norms) a 1-D dp mesh; their copies on the tp peers live
    in *other* dp sub-meshes, where each is coordinate 0 too, so every tp rank wrote
    the same box (the (pp, dp, tp) GPT's manifests were rejected as overlapping).
    A DTensor whose mesh spans the whole world has every replica on its mesh:
    :func:`is_primary_replica` decides it alone, and it is left out here."""
    claims: dict[str, tuple] = {}
    for name, t in tensors.items():
        if hasattr(t, "placements"):
            if t.device_mesh.size() >= world:
                continue
            _, pieces, primary = local_pieces(t)
            if primary and pieces:
                claims[name] = tuple((p.box.offsets, p.box.sizes) for p in pieces)
        else:
            claims[name] = ()
    for name in value_names:
        claims[name] = ()
    return claims


def replicas_left_to_others(claims: Sequence[dict[str, tuple]], rank: int) -> set[str]:
    """The names ``rank`` holds but does not write: a lower rank claims the very same
    boxes of them (``claims``: every rank's :func:`replica_claims`, by rank)."""
    owner: dict[tuple[str, tuple], int] = {}
    for r, c in enumerate(claims):
        for name, boxes in c.items():
            owner.setdefault((name, boxes), r)
    return {name for name, boxes in claims[rank].items() if owner[(name, boxes)] != rank}


def split_rows(box: Box, itemsize: int, max_bytes: int) -> list[tuple[int, Box]]:
    """Cut a box along dim 0 into boxes of at most ``max_bytes`` (at least one row).

    Returns (row offset inside ``box``, sub-box). Small chunks bound what a
    reader that wants part of a shard must fetch, and keep one checksum per
    few MiB."""
    if not box.sizes:
        return [(0, box)]
    row = itemsize
    for s in box.sizes[1:]:
        row *= s
    rows = max(1, max_bytes // max(row, 1))
    out = []
    for r in range(0, box.sizes[0], rows):
        n = min(rows, box.sizes[0] - r)
        out.append((r, Box((box.offsets[0] + r,) + box.offsets[1:], (n,) + box.sizes[1:])))
    return out


def copy_overlap(src_box: Box, src: torch.Tensor, dst_box: Box, dst: torch.Tensor) -> int:
    """Copy the overlap of two boxes from ``src`` (holding ``src_box``) into ``dst``; returns elements copied."""
    hit = src_box.intersect(dst_box)
    if hit is None:
        return 0
    dst[hit.slices_within(dst_box)].copy_(src[hit.slices_within(src_box)])
    return hit.numel
