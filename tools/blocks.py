"""Cut a tensor into row blocks of bounded bytes and read them one at a time.

This is what bounds every tool's memory: a tensor of any size is visited as
boxes of at most ``max_bytes`` (32 MiB by default), in row-major order, so the
boxes' bytes are consecutive ranges of the tensor's C-order bytes (what a
safetensors writer needs). Each block is read into one reused buffer, with at
most 32 MiB of chunk reads in flight (:mod:`.fetch`): peak memory is about
one block + 32 MiB + one chunk, whatever the checkpoint's size.
"""

from __future__ import annotations

from itertools import product
from typing import Iterator, Sequence

import torch

from resilient.snapshot.api import Manifest, TensorRecord
from resilient.snapshot.boxes import Box
from resilient.snapshot.format import dtype_from_name
from resilient.snapshot.reader import SnapshotReader

from resilient_tools.fetch import fill

DEFAULT_BLOCK = 32 << 20


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def row_blocks(shape: Sequence[int], item: int, max_bytes: int) -> Iterator[Box]:
    """Boxes tiling ``shape`` in row-major order, each at most ``max_bytes`` (one element at least).

    Trailing dims that fit are taken whole; the first that does not is cut
    into runs; dims before it are visited one index at a time."""
    shape = tuple(shape)
    if not shape:
        yield Box((), ())
        return
    if any(s == 0 for s in shape):
        return
    inner, d = item, len(shape) - 1
    while d >= 0 and inner * shape[d] <= max_bytes:
        inner *= shape[d]
        d -= 1
    if d < 0:
        yield Box((0,) * len(shape), shape)
        return
    step = max(1, max_bytes // inner)
    for lead in product(*(range(s) for s in shape[:d])):
        for start in range(0, shape[d], step):
            n = min(step, shape[d] - start)
            yield Box(tuple(lead) + (start,) + (0,) * (len(shape) - d - 1),
                      (1,) * d + (n,) + shape[d + 1:])


class BlockBuffer:
    """One reused byte buffer that row blocks are read into (fresh allocations cost 4x a copy)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._buf = torch.empty(0, dtype=torch.uint8)

    def view(self, box: Box, dtype: torch.dtype) -> torch.Tensor:
        n = box.numel * itemsize(dtype)
        if self._buf.numel() < n:
            self._buf = torch.empty(max(n, min(self.max_bytes, 1 << 20)), dtype=torch.uint8)
        return self._buf[:n].view(dtype).view(box.sizes)


def read_blocks(reader: SnapshotReader, manifest: Manifest, rec: TensorRecord, buf: BlockBuffer,
                max_bytes: int | None = None) -> Iterator[tuple[Box, torch.Tensor]]:
    """``(box, values)`` for each row block of ``rec``; ``values`` is reused by the next block.

    Every chunk read is checked against its checksum (by the reader)."""
    dtype = dtype_from_name(rec.dtype, rec.name)
    for box in row_blocks(rec.shape, itemsize(dtype), max_bytes or buf.max_bytes):
        out = buf.view(box, dtype)
        fill(reader, manifest, rec, [(box, out)])
        yield box, out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The C-order bytes of ``t`` (copied only if not contiguous), little-endian as stored."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
