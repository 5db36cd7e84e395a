"""Restore: newest complete version -> the current layout's tensors, in place.

Each rank works out the boxes its current shards cover, fetches only the
chunks that overlap them, verifies every checksum, and stages the result in
host memory. Only when *every* rank staged the same version without error
(one all-reduce: all ranks must load the same step) is anything copied into
the model, so a corrupt range never reaches it and ranks never mix versions.
Otherwise all ranks fall back to the previous complete version together
(``restore_fallback``). A restarted worker, whose freshly built state holds
nothing yet, skips the staging (``direct``): a version is read straight into
it and used only once every rank verified it; a failed one is overwritten by
the next version tried.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from resilient.snapshot.api import (
    Manifest, Restored, SnapshotError, SnapshotMismatch,
)
from resilient.snapshot.auth import admit, report as report_auth
from resilient.snapshot.boxes import Box, local_pieces
from resilient.snapshot.capture import ALIGN
from resilient.events import emit
from resilient.snapshot.flatten import iter_leaves
from resilient.snapshot.format import dtype_name
from resilient.snapshot.reader import SnapshotReader, fill_many


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_ok(ok: bool) -> bool:
    """True when every rank says ok (a MIN all-reduce; no-op without a process group)."""
    if not _dist():
        return ok
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _candidates(reader: SnapshotReader) -> list[int]:
    """Complete steps, newest first, as rank 0 sees them (so all ranks try the same list)."""
    steps = sorted(reader.complete_steps(), reverse=True) if not _dist() or dist.get_rank() == 0 else None
    if _dist():
        box = [steps]
        dist.broadcast_object_list(box, src=0)
        steps = box[0]
    return steps


class _Staging:
    """Host tensors to stage into: carved from ``arena`` (a flat uint8 buffer) while it
    lasts, then fresh. The arena is the capture ring's idle buffer: on a GPU it is pinned,
    so the final host→device copies run at full speed (measured on an H200: 55 GB/s pinned
    against 13 GB/s pageable), and on any device its pages are already faulted in."""

    def __init__(self, arena: torch.Tensor | None):
        self.arena, self.used = arena, 0

    def empty(self, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(sizes).numel() * dtype.itemsize
        start = -(-self.used // ALIGN) * ALIGN
        if self.arena is None or start + n > self.arena.numel():
            return torch.empty(sizes, dtype=dtype)
        self.used = start + n
        return self.arena[start:start + n].view(dtype).view(sizes)


def _stage(reader: SnapshotReader, m: Manifest, state: dict, config_digest: str, strict: bool,
           staging: _Staging, direct: bool = False
           ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[Any, Any, Any]], int]:
    """Read and verify this rank's part of version ``m`` into host staging tensors
    (``direct``: into the live CPU tensors themselves where their region is contiguous)."""
    if strict and config_digest and m.config_digest and m.config_digest != config_digest:
        raise SnapshotMismatch(
            f"{reader.url} step {m.step}: config digest {m.config_digest} differs from this run's "
            f"{config_digest}: it is a checkpoint of another model. Point the run at its own checkpoint "
            "URL or start fresh", reader.manifest_path(m.step))
    copies, assigns, jobs = [], [], []
    for name, value, container, key in iter_leaves(state):
        if not isinstance(value, torch.Tensor):
            if name in m.values:
                assigns.append((container, key, m.values[name]))
            elif strict:
                raise SnapshotMismatch(f"{reader.url} step {m.step}: no value {name!r} stored", reader.manifest_path(m.step))
            continue
        rec = m.tensors.get(name)
        if rec is None:
            raise SnapshotMismatch(
                f"{reader.url} step {m.step}: no tensor {name!r}; the checkpoint is of another model "
                "(or names changed). Point the run at its own checkpoint URL", reader.manifest_path(m.step))
        if rec.shape != tuple(value.shape) or rec.dtype != dtype_name(value.dtype):
            raise SnapshotMismatch(
                f"{reader.url} step {m.step}: {name!r} is {list(rec.shape)} {rec.dtype} there, "
                f"{list(value.shape)} {dtype_name(value.dtype)} here: a checkpoint of another model",
                reader.manifest_path(m.step))
        _, pieces, _ = local_pieces(value)
        local = value.to_local() if hasattr(value, "to_local") else value
        wanted = []
        for p in pieces:
            dst = local[p.local.slices_within(Box((0,) * local.dim(), tuple(local.shape)))]
            if direct and dst.device.type == "cpu" and dst.is_contiguous():
                wanted.append((p.box, dst))
                continue
            stage = staging.empty(p.box.sizes, local.dtype)
            wanted.append((p.box, stage))
            copies.append((dst, stage))
        if wanted:
            jobs.append((rec, wanted))
    nbytes = fill_many(reader, m, jobs)
    return copies, assigns, nbytes


def restore_state(reader: SnapshotReader, state: dict, *, rank: int, config_digest: str = "",
                  strict: bool = True, events: Any = None, layout: dict | None = None,
                  arena: torch.Tensor | None = None, direct: bool = False) -> Restored | None:
    """Restore ``state`` (nested dict of tensors/DTensors/JSON) in place from the newest usable version.

    Returns None when no complete version exists. Raises the newest version's
    error when versions exist but none can be restored on every rank."""
    return restore_candidates([(s, reader, "durable") for s in _candidates(reader)], state, rank=rank,
                              config_digest=config_digest, strict=strict, events=events, layout=layout,
                              arena=arena, direct=direct)


def restore_candidates(candidates: list[tuple[int, Any, str]], state: dict, *, rank: int,
                       config_digest: str = "", strict: bool = True, events: Any = None,
                       layout: dict | None = None, arena: torch.Tensor | None = None,
                       direct: bool = False, epoch: Any = None) -> Restored | None:
    """Try ``(step, reader, tier)`` in order (the same list on every rank) until one stages on
    every rank; copy it in place. A reader is a :class:`SnapshotReader` or anything with its
    ``url``, ``threads``, ``manifest``, ``manifest_path`` and ``read_chunk`` (the memory tiers);
    one with ``served_tier()`` names the tier that actually served this rank (``local``/``peer``).
    ``arena``: a flat uint8 host buffer to stage into (see :class:`_Staging`); not kept.

    ``direct``: read straight into the live tensors (those in host memory, where the
    region is contiguous) instead of staging them: for a state that holds nothing worth
    keeping yet (a restarted worker's freshly built model), where it saves a copy of the
    whole state and the staging buffer. The all-or-nothing guarantee is then per version
    tried: a version that fails on some rank may have overwritten tensors before the next
    one (which covers every tensor again) is read; if none can be restored this raises
    as always, and the state must not be used.

    ``epoch``: the run's rollback epoch (:class:`~resilient.snapshot.epoch.Epoch`; rank 0's is
    enough, as every rank falls back together): a version a rollback abandoned is refused
    (:class:`~resilient.snapshot.auth.SnapshotAbandoned`) before any of its chunks is read."""
    t0 = time.monotonic()
    first_error: SnapshotError | None = None
    for step, reader, tier in candidates:
        err: SnapshotError | None = None
        try:
            m = reader.manifest(step)
            admit(epoch, m, reader.manifest_path(step))
            with torch.no_grad():
                copies, assigns, nbytes = _stage(reader, m, state, config_digest, strict, _Staging(arena), direct)
        except SnapshotError as e:
            err = e
            report_auth(events, e)  # forged or unsigned: an auth_failure besides the fallback
        t_staged = time.monotonic()
        if _all_ok(err is None):
            t_agreed = time.monotonic()
            with torch.no_grad():
                pinned = arena is not None and arena.is_pinned()
                for dst, staged in copies:
                    dst.copy_(staged, non_blocking=pinned and dst.is_cuda)
                if pinned and torch.cuda.is_available():
                    torch.cuda.current_stream().synchronize()  # the arena is the capture ring's again
            for container, key, value in assigns:
                container[key] = value
            world = dist.get_world_size() if _dist() else 1
            resharded = m.world != world or (layout is not None and m.layout != layout)
            served = reader.served_tier() if hasattr(reader, "served_tier") else tier
            emit(events, "restore", step=m.step, url=reader.url, seconds=round(time.monotonic() - t0, 4),
                 bytes_read=nbytes, resharded=resharded, writer_world=m.world, tier=served,
                 # where the time went: reading + verifying into staging, waiting for every rank,
                 # copying into the live tensors (host→device on a GPU)
                 stage_s=round(t_staged - t0, 4), agree_s=round(t_agreed - t_staged, 4),
                 copy_s=round(time.monotonic() - t_agreed, 4))
            return Restored(step=m.step, extra=m.rank_extras.get(rank), global_extra=m.extra,
                            rank_extras=m.rank_extras, layout=m.layout, world=m.world, url=reader.url,
                            resharded=resharded)
        if err is None:
            err = SnapshotError(f"{reader.url} step {step}: another rank could not restore it (see its log)")
        first_error = first_error or err
        emit(events, "restore_fallback", step=step, url=reader.url, error=str(err),
             error_type=type(err).__name__, obj=err.obj, tier=tier)
    if first_error is not None:
        raise first_error
    return None
