"""``ckpt reshard``: rewrite a version with chunks cut for another (pp, dp, tp) layout.

Why: restore already reads any layout, but a version whose chunks match the
target's shards lets each target rank fetch exactly its bytes, one range per
chunk, with no read amplification, and lets an operator prepare a checkpoint
for a fleet of a different size offline.

Streaming: each tensor is read in row blocks of at most ``block_bytes`` into
one reused buffer; every target box's overlap with the block is written out
at once (zero-copy when the box spans whole rows, else one chunk is copied).
Peak memory is about ``block_bytes + inflight reads (32 MiB) + one chunk``
(measured: +73 MB over the interpreter for a 237 MB checkpoint with the
defaults), independent of the checkpoint's size.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient.snapshot.format import dtype_from_name

from resilient_tools.blocks import BlockBuffer, itemsize, read_blocks
from resilient_tools.layouts import Target, check_target, model_shape, param_name, rank_boxes
from resilient_tools.progress import Progress
from resilient_tools.source import Source
from resilient_tools.writer import VersionWriter


@dataclass
class ReshardResult:
    url: str
    step: int
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float


def reshard(src: Source, target: Target, out: str, *, n_heads: int | None = None, block_bytes: int = 32 << 20,
            chunk_bytes: int = 16 << 20, part_bytes: int = 64 << 20, compress: str = "auto",
            progress: bool = True, force: bool = False) -> ReshardResult:
    """Write version ``src.step`` under ``out`` laid out for ``target``; returns what was done.

    Raises :class:`LayoutError` before writing anything when the target cannot hold the model.
    ``force``: replace a version of that step already under ``out`` (kept until the new one commits)."""
    m = src.manifest
    shape = model_shape(m, n_heads)
    check_target(target, shape)
    w = VersionWriter(out, m.step, world=target.world, layout=target.as_dict(), config_digest=m.config_digest,
                      values=m.values, rank_extras=m.rank_extras, extra=m.extra, compress=compress,
                      chunk_bytes=chunk_bytes, part_bytes=part_bytes, force=force)
    total = sum(t.numel * itemsize(dtype_from_name(t.dtype, n)) for n, t in m.tensors.items())
    bar = Progress(f"reshard step {m.step} -> {target.as_dict()}", total, progress)
    buf = BlockBuffer(block_bytes)
    try:
        for name, rec in m.tensors.items():
            p = param_name(name)
            owner = m.tensors.get(f"model/{p}") if p is not None else None
            boxes = [b for _, b, primary in rank_boxes(name, rec.shape, target, shape,
                                                       owner.shape if owner is not None else None) if primary]
            w.add_tensor(name, rec.shape, dtype_from_name(rec.dtype, name))
            for block, values in read_blocks(src.reader, m, rec, buf):
                for box in boxes:
                    hit = box.intersect(block)
                    if hit is not None:
                        w.write(name, hit, values[hit.slices_within(block)])
                bar.advance(values.numel() * values.element_size())
        url = w.commit()
    except BaseException:
        w.abort()
        raise
    bar.close()
    return ReshardResult(url, m.step, len(m.tensors), bar.done, w.bytes_written, bar.seconds)

