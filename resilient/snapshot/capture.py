"""Capture: copy a rank's local shards into reused host buffers, then return.

The training thread is blocked only for this copy. A :class:`CapturePlan`
(built once per state structure) fixes where each piece of each tensor sits
in a flat host buffer and how those bytes are cut into chunks (rows of at
most ``chunk_bytes``) and parts (objects of about ``part_bytes``). Buffers
are reused: a fresh allocation costs ~4x a copy into warm memory here.

A :class:`SlotRing` double-buffers the writers: one slot is being written
out while another takes the next capture. When storage is slower than the
snapshot rate, a new capture overwrites a slot still *waiting* for upload
(coalescing: the older version is skipped), never one being written, so
memory stays at (writers + 1) copies of the shard. Writers of several tiers
share one ring: one capture feeds every tier.

On CUDA the buffers are pinned and the copies are ``non_blocking`` on a side
stream; an event marks their end, which the uploader waits for. The CPU path
is a plain ``copy_`` into the buffer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Collection

import torch

from resilient.snapshot.boxes import Box, Piece, local_pieces, split_rows
from resilient.snapshot.format import dtype_name

ALIGN = 64


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk this rank writes: ``nbytes`` at ``buf_offset`` of the host buffer are box ``box`` of ``name``."""

    name: str
    dtype: torch.dtype
    box: Box
    buf_offset: int
    nbytes: int


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[Piece, int]]  # (piece, offset in the host buffer)
    writes: bool


@dataclass
class CapturePlan:
    """Where every written byte of this rank goes: buffer offsets, chunks, parts."""

    tensors: list[TensorPlan]
    chunks: list[ChunkPlan]
    parts: list[list[int]]
    total_bytes: int
    signature: tuple


def state_signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """Identity of a state's structure; a new one means a new plan."""
    return tuple((n, tuple(t.shape), t.dtype, type(t).__name__,
                  tuple(getattr(t, "placements", ()))) for n, t in tensors.items())


def build_plan(tensors: dict[str, torch.Tensor], others_write: Collection[str] | None,
               chunk_bytes: int, part_bytes: int) -> CapturePlan:
    """Plan a rank's capture. ``others_write``: the names whose copy here another rank
    writes (:func:`~resilient.snapshot.boxes.replicas_left_to_others`; None: none)."""
    plans, chunks, offset = [], [], 0
    for name, t in tensors.items():
        shape, pieces, primary = local_pieces(t)
        writes = primary and (others_write is None or name not in others_write)
        placed = []
        if writes:
            item = t.element_size()
            for piece in pieces:
                placed.append((piece, offset))
                for row, sub in split_rows(piece.box, item, chunk_bytes):
                    row_bytes = item
                    for s in piece.box.sizes[1:]:
                        row_bytes *= s
                    chunks.append(ChunkPlan(name, t.dtype, sub, offset + row * row_bytes, sub.numel * item))
                offset += -(-piece.box.numel * item // ALIGN) * ALIGN
        plans.append(TensorPlan(name, shape, t.dtype, placed, writes))
    parts: list[list[int]] = []
    size = part_bytes
    for i, c in enumerate(chunks):
        if size + c.nbytes > part_bytes and size > 0:
            parts.append([])
            size = 0
        parts[-1].append(i)
        size += c.nbytes
    return CapturePlan(plans, chunks, parts, offset, state_signature(tensors))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class Slot:
    """One host buffer and the version captured into it."""

    index: int
    buffer: torch.Tensor | None = None
    plan: CapturePlan | None = None
    state: str = "free"  # free | capturing (a capture is being copied in) | preparing (allocated in the background)
    targets: set = field(default_factory=set)  # consumers that must still write this version
    busy: set = field(default_factory=set)     # consumers writing it now
    carry: set = field(default_factory=set)    # consumers of the version being overwritten
    step: int = -1
    seq: int = 0
    values: dict = field(default_factory=dict)
    extra: Any = None
    global_extra: Any = None
    event: Any = None  # torch.cuda.Event when the copy was asynchronous
    _pairs: tuple = ((), ())
    _pairs_key: tuple = ()
    _pairs_held: list = field(default_factory=list)
    seals: "ChunkSeals" = field(default_factory=lambda: ChunkSeals())  # this capture's chunk CRCs and MACs

    @property
    def idle(self) -> bool:
        """Neither being captured into nor wanted by any writer."""
        return self.state == "free" and not self.targets and not self.busy

    def pairs(self, tensors: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destination views into the buffer, source views of the local shards), one pair
        per written piece. Built once per plan, buffer and set of tensor objects: a training
        loop that passes the same tensors every step pays only for the copies."""
        key = (id(self.plan), self.buffer.data_ptr(), tuple(id(t) for t in tensors.values()))
        if self._pairs_key != key:
            dsts, srcs = [], []
            for tp in self.plan.tensors:
                if not tp.pieces:
                    continue
                src = _local(tensors[tp.name])
                whole = Box((0,) * src.dim(), tuple(src.shape))
                for piece, off in tp.pieces:
                    n = piece.box.numel * src.element_size()
                    dsts.append(self.buffer[off:off + n].view(tp.dtype).view(piece.box.sizes))
                    srcs.append(src[piece.local.slices_within(whole)])
            # The tensors are kept alive with the key, so their ids stay theirs.
            self._pairs, self._pairs_key, self._pairs_held = (dsts, srcs), key, list(tensors.values())
        return self._pairs

    def wait_copied(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class ChunkSeals:
    """Each chunk's CRC-32C and MAC of one capture, computed once and shared by every writer
    of it (the node store, the durable tier; the peer push carries them in the rank manifest).

    Why: every tier writes the same captured bytes; each computing its own checksums was one
    pass over the state per tier. The first writer to reach a chunk computes them (just
    before it copies the chunk out, while it is in the cache); another writer of the same
    chunk waits for that result rather than computing it again."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._done: dict[Any, Any] = {}
        self._busy: set[Any] = set()

    def get(self, key: Any, compute) -> Any:
        # One condition for all chunks, not an Event each: most chunks have one writer, and an
        # Event per chunk (a lock, a condition, three acquisitions) was a tenth of the writer's
        # Python per chunk
        with self._cond:
            while key not in self._done:
                if key not in self._busy:
                    self._busy.add(key)
                    break
                self._cond.wait()  # another writer computes it (if it failed, this one tries)
            else:
                return self._done[key]
        try:
            value = compute()
        except BaseException:
            with self._cond:
                self._busy.discard(key)
                self._cond.notify_all()
            raise
        with self._cond:
            self._busy.discard(key)
            self._done[key] = value
            self._cond.notify_all()
        return value


class SlotRing:
    """Host buffers shared by the capturing (training) thread and the writers ("consumers").

    A slot moves through: free → capturing (the training thread copies into it)
    → pending for some consumers (``targets``) → each consumer takes it (``busy``)
    and releases it → free once no consumer still needs it. One capture can feed
    several consumers (the node's RAM store and the durable tier): it is copied
    once and written by each.

    There is one slot per consumer plus one, so a capture never waits: each
    consumer writes at most one slot at a time, which leaves a slot that is free
    or only pending. Overwriting a pending slot (coalescing) hands its consumers
    the newer capture instead: a slow consumer skips to the newest version, it
    never loses its turn.
    """

    def __init__(self, slots: int = 2):
        self._slots = [Slot(i) for i in range(slots)]
        self._cond = threading.Condition()
        self._stream = None
        self._seq = 0

    def next_seq(self) -> int:
        """A number for the next capture: 0, 1, ... The same on every rank (all ranks
        capture at the same steps), so it names the capture's attempt directory."""
        with self._cond:
            self._seq += 1
            return self._seq - 1

    def add_consumer(self) -> None:
        """One more consumer shares this ring: one more slot."""
        with self._cond:
            self._slots.append(Slot(len(self._slots)))

    def acquire(self, plan: CapturePlan, pin: bool) -> tuple[Slot, int | None]:
        """A slot to capture into and the step it coalesces away (None if it was free)."""
        with self._cond:
            while True:
                free = [s for s in self._slots if s.idle]
                if free:
                    slot, skipped = free[0], None
                    break
                pending = [s for s in self._slots if s.state == "free" and not s.busy]
                if pending:
                    slot = min(pending, key=lambda s: s.step)
                    skipped = slot.step
                    break
                self._cond.wait()  # every other slot is still being allocated (preallocate)
            slot.carry, slot.targets = set(slot.targets), set()
            slot.seals = ChunkSeals()  # a new capture: the old one's CRCs and MACs are not its
            slot.state = "capturing"
        if slot.buffer is None or slot.buffer.numel() < plan.total_bytes or slot.buffer.is_pinned() != pin:
            slot.buffer = torch.empty(max(plan.total_bytes, 1), dtype=torch.uint8, pin_memory=pin)
        slot.plan = plan
        return slot, skipped

    def preallocate(self, plan: CapturePlan, pin: bool, background: bool = False, staging: bool = True) -> None:
        """Allocate every free slot's buffer for ``plan`` and touch its pages.

        ``background``: only the first slot now (a restore stages into it: :meth:`staging`;
        none when ``staging`` is False, a restore that reads straight into the model),
        the others on a thread. Why: a restart's recovery waited for all of them, ~0.25 s
        per 0.5 GB slot here (the kernel zero-fills every page) and seconds on a GPU
        (pinning), while only the staging slot is needed before the first capture, which
        waits in :meth:`acquire` if it comes first."""
        now = (1 if staging else 0) if background else len(self._slots)
        with self._cond:
            idle = [s for s in self._slots if s.idle]
            later = idle[now:]
            for s in later:
                s.state = "preparing"
        for slot in idle[:now]:
            self._allocate(slot, plan, pin)
        if later:
            threading.Thread(target=self._prepare, args=(later, plan, pin), name="snapshot-prepare",
                             daemon=True).start()

    @staticmethod
    def _allocate(slot: Slot, plan: CapturePlan, pin: bool) -> None:
        if slot.buffer is None or slot.buffer.numel() < plan.total_bytes:
            slot.buffer = torch.zeros(max(plan.total_bytes, 1), dtype=torch.uint8, pin_memory=pin)

    def _prepare(self, slots: list[Slot], plan: CapturePlan, pin: bool) -> None:
        for slot in slots:
            try:
                self._allocate(slot, plan, pin)
            finally:  # a failed allocation is retried by acquire, on the capturing thread
                with self._cond:
                    slot.state = "free"
                    self._cond.notify_all()

    def staging(self) -> torch.Tensor | None:
        """An idle slot's buffer, lent to a restore as its staging area. Safe without a
        lock held afterwards: only the training thread captures, and it is the one
        restoring; writers touch only slots that have targets."""
        with self._cond:
            idle = [s.buffer for s in self._slots if s.idle and s.buffer is not None]
        return max(idle, key=lambda b: b.numel(), default=None)

    def copy_into(self, slot: Slot, tensors: dict[str, torch.Tensor], overlap: bool) -> None:
        """Copy every written piece into ``slot``'s buffer (async on CUDA)."""
        dsts, srcs = slot.pairs(tensors)
        cuda = any(s.is_cuda for s in srcs)
        stream = None
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            if cuda:
                for src in srcs:
                    if src.is_cuda:
                        src.record_stream(stream)  # the allocator must not reuse it before the copy ran
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=cuda)
            if cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(stream)
        if cuda and not overlap:
            # The next optimizer step must not change a parameter before its copy is done.
            torch.cuda.current_stream().wait_event(slot.event)

    def fence(self) -> None:
        """Make the current CUDA stream wait for captures in flight (no CPU wait)."""
        with self._cond:
            events = [s.event for s in self._slots if s.event is not None]
        for e in events:
            torch.cuda.current_stream().wait_event(e)

    def publish(self, slot: Slot, targets: set[str]) -> None:
        """The capture in ``slot`` is complete: pending for ``targets`` (and for the
        consumers of the version it overwrote)."""
        with self._cond:
            slot.targets = set(targets) | slot.carry
            slot.carry = set()
            slot.state = "free"
            self._cond.notify_all()

    def abandon(self, slot: Slot) -> None:
        """A capture failed: the slot is free (its previous consumers lost that version)."""
        with self._cond:
            slot.carry, slot.targets, slot.state = set(), set(), "free"
            self._cond.notify_all()

    def take(self, consumer: str, timeout: timedelta) -> Slot | None:
        """The newest slot pending for ``consumer``, now busy with it; None after ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while True:
                pending = [s for s in self._slots if consumer in s.targets and s.state == "free"]
                if pending:
                    slot = max(pending, key=lambda s: s.step)
                    for older in pending:  # superseded for this consumer: it skips to the newest
                        older.targets.discard(consumer)
                    slot.busy.add(consumer)
                    self._cond.notify_all()
                    return slot
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def release(self, slot: Slot, consumer: str) -> None:
        with self._cond:
            slot.busy.discard(consumer)
            self._cond.notify_all()

    def wait_idle(self, timeout: timedelta, consumer: str | None = None) -> bool:
        """Wait until nothing is pending or being written (for ``consumer``, or for any)."""
        def working(s: Slot) -> bool:
            return bool(s.targets | s.busy) if consumer is None else consumer in (s.targets | s.busy)

        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while any(working(s) for s in self._slots):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def chunk_views(slot: Slot) -> list[memoryview]:
    """Zero-copy byte views of every planned chunk of ``slot``."""
    raw = memoryview(slot.buffer.numpy())
    return [raw[c.buf_offset:c.buf_offset + c.nbytes] for c in slot.plan.chunks]


def describe(plan: CapturePlan) -> dict[str, tuple[tuple[int, ...], str]]:
    return {tp.name: (tp.shape, dtype_name(tp.dtype)) for tp in plan.tensors}
