"""The library API: snapshots and restore for any torch training script.

    snap = Snapshotter("file:///runs/a/checkpoints", every=100)
    got = snap.restore(state)            # at start; None on a fresh run
    for step in ...:
        ...; opt.step()
        snap.save(step, state, extra={"rng": rng_state()})   # returns after the host copy
    snap.close()

``state`` is a nested dict whose leaves are tensors, DTensors or JSON values
(e.g. ``{"model": model_sd, "optim": optim_sd}`` from
``torch.distributed.checkpoint.state_dict.get_state_dict``). Tensors are
captured into host buffers on the calling thread; storage I/O happens on
background threads, so ``save`` never waits for storage or for other ranks.
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from resilient.snapshot.api import Restored
from resilient.snapshot.auth import VersionAuth
from resilient.snapshot.config import SnapshotConfig
from resilient.snapshot.boxes import replica_claims, replicas_left_to_others
from resilient.snapshot.capture import SlotRing, build_plan, state_signature
from resilient.snapshot import retention
from resilient.events import emit
from resilient.snapshot.durable import Committer, DurableOptions, Uploader
from resilient.snapshot.flatten import split_state
from resilient.snapshot.reader import SnapshotReader
from resilient.snapshot.restore import restore_state
from resilient.snapshot.storage import RetryPolicy, open_url


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _wants_pinned(tensors: dict[str, torch.Tensor]) -> bool:
    """Pinned host buffers when any tensor lives on a GPU (for asynchronous copies)."""
    return torch.cuda.is_available() and any(
        (t.to_local() if hasattr(t, "to_local") else t).is_cuda for t in tensors.values())


class Snapshotter:
    """Asynchronous, sharded, checksummed snapshots to an fsspec URL.

    Every rank of a job creates one with the same arguments (after
    ``init_process_group``) and calls :meth:`save` at the same steps.

    - ``every``: capture when ``step % every == 0`` (0: only when forced);
      ``seconds``: also capture when this much time passed since the last.
    - ``layout``: free-form dict stored in the manifest (e.g. pp/dp/tp/world).
    - ``config_digest``: identifies the model; restore refuses another's.
    - ``commit``: False for a store that something else commits (the node
      store: the agent's replicator records versions in etcd); no rank then
      runs a committer or retention.
    - ``overlap``: on CUDA, let the next kernels run before the device-to-host
      copy ends; then call :meth:`fence` before modifying the parameters
      (i.e. before ``optimizer.step()``).
    - ``share_with``: another Snapshotter whose host buffers this one shares, so
      one capture can feed both (``other.save(..., also=[this])``): the node's
      RAM store and the durable tier write the same copy of the state.
    - ``secret``: the job secret (:mod:`resilient.secret`): versions are signed with it
      and a restore loads only versions that authenticate (:mod:`.auth`). None: the one
      the environment names (``$RESILIENT_JOB_SECRET_FILE``, ``$RESILIENT_JOB_SECRET``),
      if any; without one, versions are unsigned and restore checks CRCs only.
    """

    def __init__(self, url: str, *, every: int = 1, seconds: float = 0.0, events: Any = None,
                 layout: dict | None = None, config_digest: str = "", keep_last: int = 3,
                 keep_every: int = 0, compress: str = "auto", threads: int = 4,
                 part_bytes: int = 64 << 20, chunk_bytes: int = 16 << 20,
                 storage_options: dict | None = None, retry: RetryPolicy = RetryPolicy(),
                 commit_timeout: timedelta = timedelta(minutes=30), overlap: bool = False,
                 commit: bool = True, share_with: "Snapshotter | None" = None, secret: Any = None):
        self.url, self.every, self.seconds, self.events = url, every, seconds, events
        self.rank, self.world = _rank_world()
        if seconds > 0 and self.world > 1:
            # Clocks differ between ranks: a time trigger would capture different steps on
            # different ranks. The caller decides (e.g. rank 0 broadcasts) and passes force=True.
            warnings.warn("Snapshotter(seconds=...) is ignored with several ranks; decide on one rank, "
                          "broadcast, and call save(..., force=True) on all", RuntimeWarning)
            self.seconds = 0.0
        self.layout = dict(layout or {"world": self.world})
        self.config_digest, self.overlap = config_digest, overlap
        self.storage_options, self.retry = storage_options, retry
        self.opts = DurableOptions(threads=threads, compress=compress, keep_last=keep_last,
                                   keep_every=keep_every, part_bytes=part_bytes, chunk_bytes=chunk_bytes,
                                   commit_timeout=commit_timeout, retry=retry)
        if secret is None:
            from resilient.secret import resolve_secret

            secret = resolve_secret()
        self.auth = VersionAuth(secret) if secret is not None else None
        fs, root = open_url(url, storage_options)
        if share_with is not None and share_with.url == url:
            raise ValueError(f"two Snapshotters sharing captures must write to different URLs, not both to {url}")
        self._ring = SlotRing(2) if share_with is None else share_with._ring
        if share_with is not None:
            self._ring.add_consumer()
        self._consumer = url  # this Snapshotter's name in the (possibly shared) ring
        self._committer = (Committer(fs, root, self.world, self.opts, events, url, self.auth)
                           if self.rank == 0 and commit else None)
        self._uploader = Uploader(fs, root, self.rank, self.world, self._ring, self.opts, events,
                                  self.layout, config_digest, self._committer, self._consumer, self.auth)
        self._plan = None
        self._sig: tuple = ((), ())
        self._held: list[torch.Tensor] = []
        self._pin = False  # pinned host buffers (any tensor on a GPU), decided with the plan
        self._others_write: set[str] = set()  # names held here whose copy another rank writes
        self._last_time = time.monotonic()
        self._closed = False

    @classmethod
    def from_config(cls, cfg: SnapshotConfig, url: str, **kw: Any) -> "Snapshotter":
        """A durable-tier Snapshotter from the ``[snapshot]`` config section.

        ``url`` is ``cfg.durable_url`` or the run's default; ``kw`` adds
        ``events``, ``layout``, ``config_digest``, ``storage_options``. With
        ``durable_every = "auto"`` it captures only when forced: the caller decides when
        (:class:`~resilient.snapshot.keeper.StateKeeper`, :mod:`~resilient.snapshot.interval`)."""
        every = cfg.durable_every if isinstance(cfg.durable_every, int) else 0
        return cls(url, every=every, seconds=cfg.durable_seconds, keep_last=cfg.keep_last,
                   keep_every=cfg.keep_every, compress=cfg.compress, threads=cfg.upload_threads,
                   chunk_bytes=cfg.chunk_mib << 20, part_bytes=cfg.part_mib << 20, **kw)

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` would capture (same answer on every rank for ``every``)."""
        if self.every > 0 and step % self.every == 0:
            return True
        return self.seconds > 0 and time.monotonic() - self._last_time >= self.seconds

    def _agree(self, tensors: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
        """On a new state structure (a collective): share rank 0's attempt token and pick
        one writer for every copy of an entry that several ranks hold (plain tensors, JSON
        values, DTensors replicated beyond their own mesh): the lowest rank holding it."""
        token = self._uploader.attempt or uuid.uuid4().hex[:12]
        if self.world == 1:
            self._uploader.attempt = token
            self._others_write = set()
            return
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, {"token": token,
                                          "claims": replica_claims(tensors, sorted(values), self.world)})
        self._others_write = replicas_left_to_others([g["claims"] for g in gathered], self.rank)
        self._uploader.attempt = gathered[0]["token"]

    def save(self, step: int, state: dict, extra: Any = None, global_extra: Any = None,
             force: bool = False, also: tuple["Snapshotter", ...] = ()) -> bool:
        """Capture ``state`` as version ``step`` if due (or ``force``); returns whether it did.

        Blocks only for the copy into host memory. ``extra`` is this rank's
        JSON state (RNG, ...); ``global_extra`` (rank 0's is kept) is the
        run's (data position, scheduler). Non-tensor leaves of ``state`` are
        stored as JSON (the lowest rank holding a name writes it). ``also``:
        Snapshotters made with ``share_with=self`` that write this same capture."""
        if self._closed or not (force or self.due(step)):
            return False
        for other in also:
            if other._ring is not self._ring:
                raise ValueError(f"{other.url} does not share captures with {self.url} (share_with=)")
        t0 = time.perf_counter()
        tensors, values = split_state(state)
        # The same tensor objects as last time (a training loop reusing its state dict):
        # the same structure, no need to recompute the signature. ``_held`` keeps them
        # alive, so their ids cannot be reused by other tensors meanwhile.
        same = (self._plan is not None and len(tensors) == len(self._held)
                and all(a is b for a, b in zip(tensors.values(), self._held)) and tuple(values) == self._sig[1])
        if not same:
            sig = (state_signature(tensors), tuple(values))
            if self._plan is None or self._sig != sig:
                self._agree(tensors, values)
                self._plan = build_plan(tensors, self._others_write, self.opts.chunk_bytes, self.opts.part_bytes)
                self._sig = sig
            self._held = list(tensors.values())
            self._pin = _wants_pinned(tensors)
        pin = self._pin
        others = self._others_write
        # JSON state is frozen now: the loop may mutate it (an LR scheduler) before the upload.
        frozen = json.loads(json.dumps({"extra": extra, "global": global_extra, "values": {
            k: v for k, v in values.items() if k not in others}}, allow_nan=False))
        slot, skipped = self._ring.acquire(self._plan, pin)
        try:
            with torch.no_grad():
                self._ring.copy_into(slot, tensors, self.overlap)
        except BaseException:
            self._ring.abandon(slot)
            raise
        slot.step, slot.seq, slot.extra, slot.global_extra = step, self._ring.next_seq(), frozen["extra"], frozen["global"]
        slot.values = frozen["values"]
        for other in also:  # they write under this one's attempt token (agreed by all ranks)
            other._uploader.attempt = self._uploader.attempt
            other._last_time = time.monotonic()
        self._ring.publish(slot, {self._consumer, *(o._consumer for o in also)})
        self._last_time = time.monotonic()
        blocked = time.perf_counter() - t0
        for sink in {id(x.events): x.events for x in (self, *also)}.values():
            emit(sink, "snapshot", step=step, bytes=self._plan.total_bytes, blocked_s=round(blocked, 6),
                 coalesced=skipped)
        return True

    def prepare(self, state: dict, background: bool = False, staging: bool = True) -> None:
        """Optional, before training: plan and allocate (and fault in) the host buffers,
        so the first :meth:`save` costs only its copy. Collective like :meth:`save`.
        ``background``: only the buffer a restore stages into now (none without
        ``staging``), the others on a thread (:meth:`SlotRing.preallocate`)."""
        tensors, values = split_state(state)
        self._agree(tensors, values)
        self._plan = build_plan(tensors, self._others_write, self.opts.chunk_bytes, self.opts.part_bytes)
        self._sig = (state_signature(tensors), tuple(values))
        self._held = list(tensors.values())
        self._pin = _wants_pinned(tensors)
        self._ring.preallocate(self._plan, self._pin, background, staging)

    def fence(self) -> None:
        """On CUDA with ``overlap=True``: order later kernels after the capture copies."""
        if torch.cuda.is_available():
            self._ring.fence()

    # --------------------------------------------------------------- restore
    def restore(self, state: dict, strict: bool = True, direct: bool = False) -> Restored | None:
        """Load the newest complete, verified version into ``state`` in place.

        Collective: every rank calls it. Returns None on a fresh run (no
        version); falls back to older versions when the newest is corrupt.
        ``direct``: ``state`` holds nothing worth keeping (a fresh process):
        read into it without staging (:func:`~.restore.restore_candidates`)."""
        reader = self.reader()
        return restore_state(reader, state, rank=self.rank, config_digest=self.config_digest,
                             strict=strict, events=self.events, layout=self.layout,
                             arena=None if direct else self.staging(), direct=direct)

    @property
    def epoch(self) -> int:
        """The run's rollback epoch stamped in this rank's manifests (:mod:`.epoch`; 0 before any
        rollback). The job's rank 0 sets it once it knows it: a restore refuses a version of a
        step that a rollback of a later epoch abandoned, even one put back with its MACs intact."""
        return self._uploader.epoch

    @epoch.setter
    def epoch(self, gen: int) -> None:
        self._uploader.epoch = int(gen)

    def reader(self) -> SnapshotReader:
        """A reader of this writer's URL that checks what this writer signs (the same secret)."""
        return SnapshotReader(self.url, self.storage_options, self.retry, self.opts.threads * 2, secret=self.auth)

    def staging(self) -> torch.Tensor | None:
        """A host buffer of this writer's ring (after :meth:`prepare`) that a restore may stage
        into: pinned when the state is on a GPU, so its host→device copies run at full speed."""
        return self._ring.staging()

    # ------------------------------------------------------------ lifecycle
    def wait(self, timeout: timedelta = timedelta(minutes=10)) -> bool:
        """Wait until captured versions are written (and, on rank 0, committed when possible)."""
        ok = self._ring.wait_idle(timeout, self._consumer)
        if self._committer is not None:
            ok = self._committer.wait_idle(timeout) and ok
        return ok

    def keep_at_or_below(self, step: int) -> None:
        """Retention keeps the newest complete version at or below ``step`` from now on
        (rank 0 applies retention; elsewhere a no-op)."""
        if self._committer is not None:
            self._committer.floor = step

    def drop_after(self, step: int) -> list[int]:
        """Delete the versions newer than ``step`` (a rollback; rank 0, after :meth:`wait`);
        returns their steps. Elsewhere a no-op."""
        if self._committer is None:
            return []
        return retention.drop_after(self._committer.fs, self._committer.root, step)

    def upload_error(self, step: int) -> str | None:
        """Why this rank's write of ``step`` failed (after :meth:`wait`); None if it did not."""
        return self._uploader.errors.get(step)

    @property
    def committed_step(self) -> int | None:
        """Newest step this process committed (rank 0 only; None elsewhere)."""
        return self._committer.committed if self._committer is not None else None

    def close(self, timeout: timedelta = timedelta(minutes=10), commit: bool = True) -> None:
        """Let captured versions finish writing (up to ``timeout``), then commit them.

        ``commit=False`` is for a rank that is failing: its peers are gone or going, so the
        versions still pending on rank 0's committer wait for rank manifests that will
        never come. Waiting for them held a failed worker for seconds (until its agent
        noticed the lost peer and killed it), which the whole job's recovery paid. The
        writes still finish: the node store's newest version is what restore reads."""
        if self._closed:
            return
        self._closed = True
        self._uploader.close(timeout)
        if self._committer is not None:
            self._committer.close(timeout if commit else timedelta(0))

    def __enter__(self) -> "Snapshotter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
