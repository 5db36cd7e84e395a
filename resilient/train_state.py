"""What a worker snapshots and restores, and when.

The training state of a rank is ``{"model": ..., "optim": ...}`` from torch's
``get_state_dict`` (global parameter names; FSDP2/TP shards as DTensors), plus
this rank's RNG states (per-rank extra) and the data position (global extra:
the next step and its global sample index). Everything else a step depends
on is derived from the config and the step.

:class:`TrainState` keeps the Trainer free of snapshot details: it owns the
:class:`~resilient.snapshot.Snapshotter` of the durable tier and answers
``restore()`` at start, ``after_step()`` after each optimizer step, and
``final()`` at the end or on preemption.

Under ``resilient launch`` (env ``RESILIENT_STORE`` set by the agent) a
second Snapshotter writes every ``snapshot.every``-th step into the node's
shared-memory store (``file:///dev/shm/...``, same format, no committer: the
agent replicates and commits it, :mod:`resilient.snapshot.memcommit`), and
restore tries local RAM, peer RAM, then durable
(:mod:`resilient.snapshot.tiers`). Without the agent only the durable tier runs.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resilient.config import Config
from resilient.events import EventLog
from resilient.optim import Optimizers
from resilient.optim_state import init_state
from resilient.parallel import ParallelModel
from resilient.snapshot import Restored, RetryPolicy, SnapshotReader, Snapshotter, rng_state, set_rng_state
from resilient.sdc.checksums import local as _local
from resilient.snapshot.api import StorageError
from resilient.snapshot.flatten import iter_leaves
from resilient.snapshot.restore import restore_candidates
from resilient.snapshot.tiers import StoreInfo, forget_after, tiered_candidates

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


def durable_url(cfg: Config, run_dir: Path) -> str:
    return cfg.snapshot.durable_url or (run_dir / "checkpoints").as_uri()


class Marks:
    """Seconds since the previous mark, per phase name, into ``out`` (run_start's ``startup``)."""

    def __init__(self, out: dict[str, float]):
        self.out, self.last = out, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.out[phase] = round(now - self.last, 4)
        self.last = now


def init_optimizer_state(model: ParallelModel, optimizers: Optimizers) -> None:
    """Materialize AdamW's state (zeros, step 0) so a restore has tensors to fill,
    packed into one flat buffer (:func:`resilient.optim_state.init_state`)."""
    for part, opt in zip(model.parts, optimizers.optimizers):
        init_state(opt, part)


class TrainState:
    def __init__(self, cfg: Config, run_dir: Path, model: ParallelModel, optimizer: Optimizers,
                 events: EventLog):
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.events = events
        self.timings: dict[str, float] = {}  # seconds of the last restore's parts (run_start's startup)
        self.setup_timings: dict[str, float] = {}   # where the set-up went (run_start's startup: snapshots.*)
        mark = Marks(self.setup_timings)
        init_optimizer_state(model, optimizer)
        mark("optimizer_state")
        self._state: dict | None = None
        self._state_key: tuple = ()
        snap = cfg.snapshot
        self.last_saved = -1
        self.durable_step = -1  # newest step captured for (or restored from) the durable tier
        self.store = StoreInfo.from_env() if snap.every > 0 and snap.memory else None
        self.memory: Snapshotter | None = None
        if self.store is not None:
            # tmpfs: nothing to compress, little to retry; a full store must not stall the writer.
            self.memory = Snapshotter(
                self.store.store.url, every=snap.every, events=_ErrorsOnly(events), layout=model.layout.as_dict(),
                config_digest=cfg.digest(), compress="none", threads=2, chunk_bytes=snap.chunk_mib << 20,
                part_bytes=snap.part_mib << 20, commit=False,
                retry=RetryPolicy(deadline=timedelta(seconds=2), attempts=2))
        self.durable: Snapshotter | None = None
        mark("memory_tier")
        if snap.durable_every or snap.durable_seconds or snap.resume:
            # One capture feeds both tiers: the durable writer shares the RAM store's buffers.
            self.durable = Snapshotter.from_config(
                snap, durable_url(cfg, run_dir), events=events, layout=model.layout.as_dict(),
                config_digest=cfg.digest(), share_with=self.memory)
        mark("durable_tier")

    def _identity(self) -> tuple:
        """Which tensor objects the state is made of: parameters and optimizer state.
        Unchanged between steps (the optimizer updates them in place); a restore or a
        new optimizer state replaces some, which changes this."""
        ids = [id(p) for part in self.model.parts for p in part.parameters()]
        for opt in self.optimizer.optimizers:
            for st in opt.state.values():
                ids.extend(id(v) for v in st.values())
        return tuple(ids)

    def state(self) -> dict:
        """The state dict of every stage, built once and reused while its tensors are the
        same objects (``get_state_dict`` costs more than the capture's copy at this size).

        Global names throughout: the stage modules' names do not overlap."""
        key = self._identity()
        if self._state is None or self._state_key != key:
            self._state, self._state_key = self._build_state(), key
        return self._state

    def _build_state(self) -> dict:
        state: dict = {"model": {}, "optim": {}}
        for part, opt in zip(self.model.parts, self.optimizer.optimizers):
            model_sd, optim_sd = get_state_dict(part, opt)
            state["model"].update(model_sd)
            # Only the per-parameter state: hyperparameters (param_groups) come
            # from the config and the step, whatever layout wrote the snapshot.
            state["optim"].update(optim_sd["state"])
        return state

    def restore(self, max_step: int | None = None, fresh: bool = False) -> Restored | None:
        """Load the newest complete version (at most ``max_step``, for a
        rollback) into the model and optimizer, in place, resharded to this
        layout. Returns None on a fresh run. ``fresh``: the state holds nothing
        yet (the process's first restore), so it may be read into directly."""
        if self.durable is None or not self.cfg.snapshot.resume:
            return None
        t0 = time.perf_counter()
        state = self.state()
        # At start-up the state holds nothing yet (the model is built uninitialized): read
        # the version straight into it on the host. A rollback stages, so that a version
        # that fails half-way leaves the live state as it was. On a GPU the restore stages
        # through the capture ring's pinned buffer for fast host→device copies.
        direct = fresh and all(_local(v).device.type == "cpu" for section in state.values()
                                          for _, v, _, _ in iter_leaves(section) if isinstance(v, torch.Tensor))
        # Allocate the capture buffers now rather than in the first saves (on a GPU they are
        # pinned, which costs seconds per GB-scale slot), on a thread but for the staging one;
        # after the restore when it needs none (the thread would compete with it for cores).
        writer = self.memory if self.memory is not None else (
            self.durable if self.cfg.snapshot.durable_every or self.cfg.snapshot.durable_seconds else None)
        if writer is not None and not direct:
            writer.prepare(state, background=True)
        arena = writer.staging() if writer is not None and not direct else None
        self.timings["prepare_buffers"] = round(time.perf_counter() - t0, 4)
        if self.store is None and max_step is None:
            restored = self.durable.restore(state, direct=direct)
        else:
            restored = self._restore_tiered(state, max_step, arena, direct)
        if writer is not None and direct:
            writer.prepare(state, background=True, staging=False)
        if restored is None:
            return None
        t1 = time.perf_counter()
        if not self._restored_in_place(state):
            self._load(state)
        self.timings["load"] = round(time.perf_counter() - t1, 4)
        if restored.extra is not None:
            set_rng_state(restored.extra["rng"])
        # The restored version exists already: saving it again at the end (a run restored at
        # its last step) would only write a second attempt of the same state.
        self.last_saved = restored.step
        if not restored.url.startswith("memory://"):
            self.durable_step = restored.step
        return restored

    def _restored_in_place(self, state: dict) -> bool:
        """Is every leaf of ``state`` a view of the model's or the optimizer's own storage?
        Then the restore, which copies into the leaves in place, already loaded everything.

        Why ask: torch's ``set_state_dict`` copies the parameters again and rebuilds the
        optimizer's state as new tensors (a copy of all of it, and every plan cached by
        those tensors starts over), on every restart. It is still used when a leaf is not
        the live storage (a non-tensor leaf, or a layout where the state dict holds copies)."""
        live = set()
        for part in self.model.parts:
            live.update(_local(p).data_ptr() for p in part.parameters())
        for opt in self.optimizer.optimizers:
            for st in opt.state.values():
                live.update(_local(v).data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        leaves = [v for section in (state["model"], state["optim"]) for _, v, _, _ in iter_leaves(section)]
        return all(isinstance(v, torch.Tensor) and (v.numel() == 0 or _local(v).data_ptr() in live) for v in leaves)

    def _load(self, state: dict) -> None:
        """Load ``state`` into the model and the optimizers with torch's ``set_state_dict``."""
        for part, opt in zip(self.model.parts, self.optimizer.optimizers):
            names = {n for n, _ in part.named_parameters()}
            groups = get_state_dict(part, opt)[1]["param_groups"]
            set_state_dict(part, opt,
                           model_state_dict={k: v for k, v in state["model"].items() if k in names},
                           optim_state_dict={"state": {k: v for k, v in state["optim"].items() if k in names},
                                             "param_groups": groups})
        self._state = None  # set_state_dict may have replaced optimizer state tensors
        self.optimizer.pack_state()  # ... then pack them again

    def _restore_tiered(self, state: dict, max_step: int | None = None,
                        arena: torch.Tensor | None = None, direct: bool = False) -> Restored | None:
        durable = SnapshotReader(self.durable.url, self.durable.storage_options, self.durable.retry)
        secret = self.store.secret() if self.store is not None else None
        candidates, readers = tiered_candidates(self.store, durable, self.events, secret)
        if max_step is not None:
            candidates = [c for c in candidates if c[0] <= max_step]
        try:
            restored = restore_candidates(candidates, state, rank=self.durable.rank,
                                          config_digest=self.cfg.digest(), events=self.events,
                                          layout=self.model.layout.as_dict(), arena=arena, direct=direct)
        finally:
            for r in readers:
                r.close()
        # A rollback (max_step) drops later versions of every tier itself: abandon_after.
        if restored is not None and self.durable.rank == 0 and self.store is not None and max_step is None:
            try:
                forget_after(self.store, restored.step)
            except Exception:  # bookkeeping; the next commits go on regardless
                pass
        return restored

    def after_step(self, step: int, force: bool = False) -> None:
        """Called after optimizer step ``step`` (completed steps): capture into each tier that is due."""
        if step == self.last_saved:
            return
        durable = self.durable is not None and (force or self.durable.due(step))
        memory = self.memory is not None and (force or self.memory.due(step))
        if not (durable or memory):
            return
        state = self.state()
        extra = {"rng": rng_state()}
        position = self._global_extra(step)
        if memory:
            self.memory.save(step, state, extra=extra, global_extra=position, force=True,
                             also=(self.durable,) if durable else ())
        elif durable:
            self.durable.save(step, state, extra=extra, global_extra=position, force=True)
        if durable:
            self.durable_step = step
        self.last_saved = step

    def final(self, step: int, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Make sure ``step`` is durable before the process ends (end of run, preemption)."""
        if self.durable is None:
            return
        if self.last_saved != step:
            self.after_step(step, force=True)  # every tier
        elif self.durable_step != step:  # memory has it, durable not yet
            self.durable_step = step
            self.durable.save(step, self.state(), extra={"rng": rng_state()},
                              global_extra=self._global_extra(step),
                              force=True)
        if self.memory is not None:
            self.memory.wait(timeout)
        self.durable.wait(timeout)
        # Training goes on past a failed upload, but the end of a run must not: exiting 0
        # would say the trained state is safe. The error ends this worker (the agent
        # retries, then gives up with this message).
        err = self.durable.upload_error(step)
        if err is None and self.durable.committed_step not in (None, step):
            err = f"not committed (newest committed: step {self.durable.committed_step})"
        if err is not None:
            raise StorageError(f"the final snapshot of step {step} could not be made durable at "
                               f"{self.durable.url}: {err}", self.durable.url)

    def committed(self) -> dict[str, int]:
        """The newest committed step per tier this process can see (for the progress line):
        ``local``/``peer`` from the agent, ``durable`` from this rank's committer (rank 0)."""
        out = dict(self.store.store.read_committed()) if self.store is not None else {}
        if self.durable is not None and self.durable.committed_step is not None:
            out["durable"] = self.durable.committed_step
        return out

    def _global_extra(self, step: int) -> dict:
        """The data position, and the model's shape so tools (``resilient ckpt
        reshard``) can check a target layout without our config file."""
        return {"step": step, "sample_index": step * self.cfg.train.global_batch,
                "config": {"model": dataclasses.asdict(self.cfg.model)}}

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
        if self.durable is None or self.durable.rank != 0:
            return
        if self.store is not None:
            forget_after(self.store, step)
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
