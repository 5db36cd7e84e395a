"""What a worker snapshots and restores, and when: every tier behind one object (the worker's
side of the snapshot path; the node's side is the agent's store service and the replicator,
:mod:`resilient.snapshot.memcommit`).

:class:`StateKeeper` owns the two writers of a worker and the tiered restore:

- under ``resilient launch`` (env ``RESILIENT_STORE`` set by the agent) a
  :class:`~resilient.snapshot.Snapshotter` writes every ``snapshot.every``-th
  step into the node's shared-memory store (``file:///dev/shm/...``, same
  format, no committer: the agent replicates and commits it,
  :mod:`resilient.snapshot.memcommit`), and restore tries local RAM, peer
  RAM, then durable (:mod:`resilient.snapshot.tiers`);
- the durable tier (``snapshot.durable_url``, default ``RUN_DIR/checkpoints``)
  shares the memory writer's host buffers: one capture feeds both.

Without the agent (plain ``torchrun`` or ``python``) only the durable tier runs.

A tier whose interval is ``"auto"`` is due when :class:`~resilient.snapshot.interval.AutoSchedule`
says (every rank agrees), from what its versions cost: the keeper times each capture, taps the
durable uploads' throughput, and reads the agent's push and commit costs from the node store.

The keeper knows nothing of models: it saves and restores whatever dict of
tensors and JSON values ``state_fn()`` returns (global names, DTensor shards
resharded on restore) and calls ``load_fn(state)`` once a restore has written
into it. :class:`resilient.job.Job` gives it the user's state; the built-in
trainer goes through the same ``Job``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from resilient.events import EventLog
from resilient.progress import Marks
from resilient.ledger import run_copies
from resilient.snapshot import Restored, RetryPolicy, Snapshotter
from resilient.snapshot.api import StorageError
from resilient.snapshot.commits import read_run_epoch
from resilient.snapshot.config import AUTO, SnapshotConfig
from resilient.snapshot.epoch import Epoch
from resilient.snapshot.interval import HISTORY_KEY, AutoSchedule, Intervals, schedule_group
from resilient.snapshot.flatten import iter_leaves
from resilient.snapshot.restore import restore_candidates
from resilient.snapshot.tiers import StoreInfo, forget_after, tiered_candidates

log = logging.getLogger(__name__)

# A failing rank's wait for its in-flight snapshot writes: the node store's (tmpfs) take
# milliseconds; a durable upload cut short is never committed and is collected later.
FAILED_CLOSE = timedelta(seconds=2)


class _ErrorsOnly:
    """Events of the every-step memory writer: only its errors (a snapshot and an upload
    event per rank per step would drown the log; the agent's commit events say enough)."""

    def __init__(self, events: EventLog):
        self.events = events

    def emit(self, kind: str, **fields) -> None:
        # FileNotFoundError/FileExistsError: the agent retired an older version while a late
        # write of it (the uploader writes the newest pending capture first) was landing; expected.
        if kind == "upload_error" and not str(fields.get("error", "")).startswith(("FileNotFoundError",
                                                                                  "FileExistsError")):
            self.events.emit(kind, tier="local", **fields)


@dataclass
class _UploadTap:
    """The durable writer's events, passed on; each upload's size and duration kept (the
    durable tier's link, for an auto interval)."""

    events: EventLog
    last: tuple[float, float] = (0.0, 0.0)   # bytes, seconds of the newest upload

    def emit(self, kind: str, **fields) -> None:
        if kind == "upload":
            self.last = (float(fields.get("bytes") or 0), float(fields.get("seconds") or 0))
        self.events.emit(kind, **fields)


def _job_secret(store: StoreInfo | None, run_dir: Path) -> bytes:
    """The job secret: the agent's (under ``resilient launch``); without an agent (plain
    ``torchrun``, ``python``) the one the environment names, else ``RUN_DIR/job.secret``
    (created 0600 by the first process; nodes that share no run dir must be given one)."""
    if store is not None:
        return store.secret()
    from resilient.secret import resolve_secret, run_dir_secret

    # (not provide_job_secret: that names the file in this process's environment, for the
    # agent's children; a script's own process keeps its environment as it was)
    found = resolve_secret() or resolve_secret(run_dir_secret(run_dir))
    return found.material


def durable_url(cfg: SnapshotConfig, run_dir: Path) -> str:
    return cfg.durable_url or (Path(run_dir) / "checkpoints").as_uri()


class StateKeeper:
    """Saves ``state_fn()`` into every due tier after a step; restores the newest version.

    - ``state_fn() -> dict``: the state to save and to restore into (tensors in place,
      JSON leaves assigned back into their containers). Called often: cache it.
    - ``load_fn(state)``: after a restore wrote into ``state``, make it live (e.g. torch's
      ``set_state_dict`` where the state dict's tensors are copies).
    - ``layout``: stored in each manifest (``world``, ``dp``...); ``config_digest``:
      identifies the model, a restore refuses another model's versions.
    """

    def __init__(self, cfg: SnapshotConfig, run_dir: Path, state_fn: Callable[[], dict],
                 load_fn: Callable[[dict], None], events: EventLog, *, layout: dict,
                 config_digest: str = ""):
        self.cfg, self.state_fn, self.load_fn, self.events = cfg, state_fn, load_fn, events
        self.layout, self.config_digest = layout, config_digest
        self.timings: dict[str, float] = {}  # seconds of the last restore's parts (run_start's startup)
        self.setup_timings: dict[str, float] = {}
        mark = Marks(self.setup_timings)
        self.last_saved = -1
        self.durable_step = -1  # newest step captured for (or restored from) the durable tier
        self.store = StoreInfo.from_env() if cfg.memory_on else None
        # Every tier signs its versions and restores only those that authenticate (snapshot.auth).
        self.secret = _job_secret(self.store, run_dir)
        # the run's ledger beside etcd (the rollback epoch: resilient.snapshot.epoch)
        self.ledger = run_copies(run_dir, cfg.durable_url) if self.store is not None else []
        self.memory: Snapshotter | None = None
        if self.store is not None:
            # tmpfs: nothing to compress, little to retry; a full store must not stall the writer.
            self.memory = Snapshotter(
                self.store.store.url, every=0 if cfg.every == AUTO else cfg.every, events=_ErrorsOnly(events),
                layout=layout, config_digest=config_digest, compress="none", threads=2, chunk_bytes=cfg.chunk_mib << 20,
                part_bytes=cfg.part_mib << 20, commit=False, secret=self.secret,
                retry=RetryPolicy(deadline=timedelta(seconds=2), attempts=2))
        self.durable: Snapshotter | None = None
        mark("memory_tier")
        self._tap = _UploadTap(events) if cfg.durable_every == AUTO else None
        if cfg.durable_every or cfg.durable_seconds or cfg.resume:
            # One capture feeds both tiers: the durable writer shares the RAM store's buffers.
            self.durable = Snapshotter.from_config(
                cfg, durable_url(cfg, run_dir), events=self._tap or events, layout=layout,
                config_digest=config_digest, share_with=self.memory, secret=self.secret)
        # "auto" intervals: chosen as the job runs, the same on every rank (one all-reduce per choice)
        auto = tuple(t for t in cfg.auto_tiers if (self.memory if t == "memory" else self.durable) is not None)
        self.auto = AutoSchedule(cfg, auto, events, self.rank, schedule_group(cfg, self._world())) if auto else None
        mark("durable_tier")

    @property
    def rank(self) -> int:
        writer = self.durable or self.memory
        return writer.rank if writer is not None else 0

    def _world(self) -> int:
        writer = self.durable or self.memory
        return writer.world if writer is not None else 1

    def _due(self, tier: str, step: int) -> bool:
        """Whether ``tier`` takes a version at ``step``: its fixed interval, or the auto choice."""
        writer = self.memory if tier == "memory" else self.durable
        if writer is None:
            return False
        if self.auto is not None and tier in self.auto.tiers:   # (the writer's own every is 0)
            return self.auto.due(tier, step) or writer.due(step)
        return writer.due(step)

    def _history(self, global_extra: Callable[[], Any], ended: bool = False) -> Callable[[], Any]:
        """``global_extra`` plus, with auto intervals, what the next incarnation takes up
        (the intervals, failures and training time: :meth:`AutoSchedule.history`)."""
        if self.auto is None:
            return global_extra

        def with_history() -> Any:
            g = global_extra()
            return {**g, HISTORY_KEY: self.auto.history(ended)} if isinstance(g, dict) else g
        return with_history

    def intervals(self) -> Intervals:
        """Each tier's interval now (the auto choice where ``"auto"``)."""
        return Intervals.of(self.cfg, self.auto)

    def interval_text(self) -> str:
        """The auto intervals for the progress line; empty when every interval is fixed."""
        return self.auto.text() if self.auto is not None else ""

    # ------------------------------------------------------------ restore
    def restore(self, max_step: int | None = None, fresh: bool = False,
                before: Callable[[], None] | None = None) -> Restored | None:
        """Load the newest complete version (at most ``max_step``, for a rollback) into the
        state, in place, resharded to this layout. Returns None when there is none.

        ``fresh``: the state holds nothing worth keeping (a model built uninitialized): read
        straight into it. Otherwise the version is staged first, so one that fails half-way
        leaves the live state as it was. ``before()`` runs once a version is known to exist,
        before the state is asked for (the optimizer's state materialized: tensors to fill;
        a fresh run never pays for it). ``snapshot.resume = false`` skips the start-up
        restore, not a rollback's. Collective."""
        if self.durable is None or (not self.cfg.resume and max_step is None):
            self._learn_epoch()
            return None
        t0 = time.perf_counter()
        durable = self.durable.reader()
        candidates, readers, epoch = tiered_candidates(self.store, durable, self.events, self.secret, self.ledger)
        self._stamp(epoch)
        on_durable = {c[0] for c in candidates if c[2] == "durable"}   # the same set on every rank
        try:
            if max_step is not None:
                candidates = [c for c in candidates if c[0] <= max_step]
            if not candidates:
                return None
            if before is not None:
                before()
            restored, state = self._restore_from(candidates, fresh, t0, epoch)
        finally:
            for r in readers:
                r.close()
        # A rollback (max_step) drops later versions of every tier itself: abandon_after.
        if restored is not None and self.rank == 0 and self.store is not None and max_step is None:
            try:
                self._stamp(forget_after(self.store, restored.step, self.ledger, always=False, events=self.events))
            except Exception:  # bookkeeping; the next commits go on regardless
                pass
        if restored is None:
            return None
        if self.auto is not None:
            g = restored.global_extra
            self.auto.restored(restored.step, g.get(HISTORY_KEY) if isinstance(g, dict) else None,
                               max((s for s in on_durable if s <= restored.step), default=None),
                               rollback=max_step is not None)
        t1 = time.perf_counter()
        self.load_fn(state)   # the dict the restore wrote into: JSON leaves were assigned in it
        self.timings["load"] = round(time.perf_counter() - t1, 4)
        # The restored version exists already: saving it again at the end (a run restored at
        # its last step) would only write a second attempt of the same state.
        self.last_saved = restored.step
        if not restored.url.startswith("memory://") or restored.step in on_durable:
            # durable already (a preemption's final save, say): catch_up must not write it again
            self.durable_step = restored.step
        return restored

    def _stamp(self, epoch: Epoch | None) -> None:
        """Rank 0 learned the run's rollback epoch: its versions of every tier carry it from now
        on (rank 0's manifest speaks for the version: :func:`~resilient.snapshot.auth.admit`)."""
        if epoch is None:
            return
        for writer in (self.memory, self.durable):
            if writer is not None:
                writer.epoch = max(writer.epoch, epoch.gen)

    def _learn_epoch(self) -> None:
        """No restore at start (``snapshot.resume = false``): rank 0 still reads the run's epoch,
        so its new versions are not stamped with one a past rollback closed."""
        if self.store is None or self.rank != 0:
            return
        try:
            with self.store.client() as client:
                self._stamp(read_run_epoch(client, self.store.run_id, self.secret, self.ledger, self.events))
        except Exception as e:   # bookkeeping: the restore of a later start reads it again
            log.warning("could not read the run's rollback epoch: %s", e)

    def _restore_from(self, candidates: list, fresh: bool, t0: float,
                      epoch: Epoch | None = None) -> tuple[Restored | None, dict]:
        state = self.state_fn()
        direct = fresh and all(getattr(v, "_local_tensor", v).device.type == "cpu" for _, v, _, _ in iter_leaves(state)
                               if isinstance(v, torch.Tensor))
        # Allocate the capture buffers now rather than in the first saves (on a GPU they are
        # pinned, which costs seconds per GB-scale slot), on a thread but for the staging one;
        # after the restore when it needs none (the thread would compete with it for cores).
        writer = self.memory if self.memory is not None else (
            self.durable if self.cfg.durable_every or self.cfg.durable_seconds else None)
        if writer is not None and not direct:
            writer.prepare(state, background=True)
        arena = writer.staging() if writer is not None and not direct else None
        self.timings["prepare_buffers"] = round(time.perf_counter() - t0, 4)
        restored = restore_candidates(candidates, state, rank=self.rank, config_digest=self.config_digest,
                                      events=self.events, layout=self.layout, arena=arena, direct=direct,
                                      epoch=epoch)
        if writer is not None and direct:
            writer.prepare(state, background=True, staging=False)
        return restored, state

    def catch_up(self, step: int, extra: Callable[[], Any], global_extra: Callable[[], Any]) -> bool:
        """After a restore from a memory tier at ``step``: write the durable version that was due
        there if the lost run had not made it durable yet (a crash between the RAM commit and
        the upload), so the durable history has no gap. Returns whether it saved."""
        if self.durable is None or self.durable_step >= step or not self._due("durable", step):
            return False
        self.durable.save(step, self.state_fn(), extra=extra(), global_extra=self._history(global_extra)(), force=True)
        self.durable_step = step
        if self.auto is not None and "durable" in self.auto.tiers:
            self.auto.tiers["durable"].last = step   # the next durable version counts from here
        return True

    # --------------------------------------------------------------- save
    def after_step(self, step: int, extra: Callable[[], Any], global_extra: Callable[[], Any],
                   force: bool = False) -> None:
        """Called after optimizer step ``step`` (completed steps): capture into each tier that
        is due. ``extra()`` is this rank's JSON state, ``global_extra()`` the run's (rank 0's kept);
        both are called only when a capture happens."""
        if self.auto is not None:
            self.auto.step_ended()
        if step == self.last_saved:
            return
        durable = self.durable is not None and (force or self._due("durable", step))
        memory = self.memory is not None and (force or self._due("memory", step))
        if not (durable or memory):
            return
        t0 = time.perf_counter()
        state = self.state_fn()
        global_extra = self._history(global_extra, ended=force)   # force: the end-of-run save (final)
        if memory:
            self.memory.save(step, state, extra=extra(), global_extra=global_extra(), force=True,
                             also=(self.durable,) if durable else ())
        elif durable:
            self.durable.save(step, state, extra=extra(), global_extra=global_extra(), force=True)
        if durable:
            self.durable_step = step
        self.last_saved = step
        if self.auto is not None:
            self.auto.captured(step, tuple(t for t, on in (("memory", memory), ("durable", durable)) if on),
                               time.perf_counter() - t0)
            if not force:   # the last save of a run chooses nothing (and needs no collective)
                self._measure_links()
                self.auto.maybe_choose(step)

    def _measure_links(self) -> None:
        """The newest link costs: the durable uploads' (tapped), the agent's pushes and etcd
        commits (published in the node store beside its commits, :mod:`.memcommit`)."""
        if self._tap is not None:
            self.auto.link("durable", *self._tap.last)
        if self.store is not None and "memory" in self.auto.tiers:
            got = self.store.store.read_committed()
            self.auto.link("memory", got.get("push_bytes", 0), got.get("push_us", 0) / 1e6,
                           got.get("commit_us", 0) / 1e6)

    def final(self, step: int, extra: Callable[[], Any], global_extra: Callable[[], Any],
              timeout: timedelta = timedelta(minutes=10)) -> None:
        """Make sure ``step`` is durable before the process ends (end of run, preemption).
        Raises :class:`StorageError` when it could not be: exiting 0 would say it is safe."""
        if self.durable is None:
            return
        if self.last_saved != step:
            self.after_step(step, extra, global_extra, force=True)  # every tier
        elif self.durable_step != step:  # memory has it, durable not yet
            self.durable_step = step
            self.durable.save(step, self.state_fn(), extra=extra(), global_extra=self._history(global_extra, True)(),
                              force=True)
        if self.memory is not None:
            self.memory.wait(timeout)
        self.durable.wait(timeout)
        err = self.durable.upload_error(step)
        if err is None and self.durable.committed_step not in (None, step):
            err = f"not committed (newest committed: step {self.durable.committed_step})"
        if err is not None:
            raise StorageError(f"the final snapshot of step {step} could not be made durable at "
                               f"{self.durable.url}: {err}", self.durable.url)

    # ---------------------------------------------------------- bookkeeping
    def committed(self) -> dict[str, int]:
        """The newest committed step per tier this process can see (for the progress line):
        ``local``/``peer`` from the agent, ``durable`` from this rank's committer (rank 0)."""
        got = self.store.store.read_committed() if self.store is not None else {}
        out = {t: s for t, s in got.items() if t in ("local", "peer")}   # (not the agent's costs)
        if self.durable is not None and self.durable.committed_step is not None:
            out["durable"] = self.durable.committed_step
        return out

    def keep_verified(self, step: int) -> None:
        """The SDC checks verified the state of ``step``: a rollback would go back there,
        so durable retention must keep a version at or below it."""
        if self.durable is not None:
            self.durable.keep_at_or_below(step)

    def abandon_after(self, step: int) -> None:
        """At a rollback to ``step``: no restart may ever restore a newer version (it may
        hold the corruption rolled back from). Rank 0 drops their commit records in etcd
        (memory tiers) and deletes them from the durable tier; call after
        :meth:`wait_idle`, so no write of theirs is still in flight."""
        if self.durable is None or self.rank != 0:
            return
        if self.store is not None:
            self._stamp(forget_after(self.store, step, self.ledger, events=self.events))
        dropped = self.durable.drop_after(step)
        if dropped:
            self.events.emit("gc", step=step, removed=dropped, kept=[], reason="rollback")

    def wait_idle(self, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Let captured versions finish writing (before a rollback picks the newest)."""
        for snap in (self.memory, self.durable):
            if snap is not None:
                snap.wait(timeout)

    def close(self, failed: bool = False) -> None:
        """Finish writing captured versions. ``failed``: this rank is failing (a peer died,
        an error): bounded waits, no waiting for commits that need every rank
        (:meth:`Snapshotter.close`)."""
        timeout = FAILED_CLOSE if failed else timedelta(minutes=10)
        if self.memory is not None:
            self.memory.close(timeout, commit=not failed)
        if self.durable is not None:
            self.durable.close(timeout, commit=not failed)
