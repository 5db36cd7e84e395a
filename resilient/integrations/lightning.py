"""PyTorch Lightning on :class:`resilient.Job`: one callback gives a ``Trainer`` every tier.

The lines a user adds (``pip install 'resilient[lightning]'``)::

    from resilient.integrations.lightning import ResilientCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[ResilientCallback()])
    trainer.fit(model, data)          # a killed run started again resumes where it stopped

What the callback does, at Lightning's hooks:

- ``on_fit_start`` (the model is on its device, DDP-wrapped, its optimizer built): creates
  the Job with the strategy's model (under DDP its wrapper: the SDC replica checks compare
  every rank's gradients and parameters bitwise) and optimizer, the LR schedulers, the fit loop's
  progress and the precision plugin as ``state`` (:mod:`.lightning_state`), and restores
  the newest committed version from the fastest tier: weights, optimizer, schedulers,
  global step, epoch and batch progress, the training data's position (for a loader with
  ``state_dict()``), and the RNGs (torch, Python, numpy). A killed run started again ends
  bitwise equal to one that was never killed.
- ``on_before_optimizer_step``: the SDC gradient checks (:meth:`Job.verify`). A suspect
  step is replayed: the callback runs the batch's ``training_step`` and backward again
  through the strategy, with the RNG as it was at the batch's start. Replay needs one
  forward/backward per optimizer step: with manual optimization, gradient accumulation or
  a grad scaler (16-bit AMP) there is none to give, and a suspect step ends the fit
  instead (:class:`SdcError`).
- ``on_train_batch_end`` (after the optimizer step, where Lightning's own checkpoints are
  saved): the step boundary (:meth:`Job.end_step`): heartbeat, the ``step`` event, a
  snapshot into every due tier, the at-rest checks.
- Preemption: Lightning owns SIGTERM (its handler notes it, and under DDP rank 0's notice
  reaches every rank); the callback agrees on it across ranks at the step boundary, makes
  that step durable, and stops the trainer. Lightning then ends ``fit`` with its
  ``SIGTERMException`` (a ``SystemExit``: exit status 0).
- A rollback (the checks found the state corrupt and loaded the newest verified version)
  cannot rewind Lightning's loop in place: the fit ends with :class:`SdcRollback`; under
  ``resilient launch`` the worker is restarted and resumes from the verified version, under
  plain ``python`` run it again.
- ``on_fit_end`` / ``on_exception``: the last step made durable, the Job closed.

Under ``resilient launch`` (``resilient launch --nproc-per-node 2 train.py``, with
``Trainer(strategy="ddp", devices=<LOCAL_WORLD_SIZE>, num_nodes=<nodes>)``: Lightning
reads torchrun's environment) the Job also writes the node-RAM and peer tiers; under plain
``python`` or ``torchrun`` the durable tier in the run dir.

Limits: one optimizer, stepped at most once per training batch; strategies whose model
torch's state-dict API reads (tested: single device and DDP, on CPU; not DeepSpeed);
``fit(ckpt_path=...)`` is refused (the run dir is the checkpoint). Not saved: other
callbacks' state (``ModelCheckpoint``'s best-k) and the LightningModule's
``on_save_checkpoint`` extras: keep such state in ``state=``.
"""

from __future__ import annotations

import importlib
import inspect
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch

from resilient.errors import ResilientError
from resilient.integrations.lightning_state import RankState, TrainerState, apply_restored
from resilient.job import Job, JobError, JobOptions
from resilient.sdc.api import SdcError
from resilient.snapshot import rng_state, set_rng_state

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")   # the unified package first, then the standalone one


def _callback_base() -> type:
    """Lightning's ``Callback``, of the Lightning package the script already imported, else of the
    first that imports (both installed: either Trainer calls the hooks of either's callbacks)."""
    for name in _PACKAGES:
        if name in sys.modules:
            return sys.modules[name].Callback
    for name in _PACKAGES:
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise ImportError("resilient.integrations.lightning needs PyTorch Lightning: "
                      "pip install 'resilient[lightning]' (or lightning / pytorch-lightning)")


class SdcRollback(ResilientError):
    """The SDC checks rolled the state back to a verified version; Lightning cannot rewind
    its loop in place: run the fit again (``resilient launch`` restarts the worker) and it
    resumes from that version."""


class LightningAdapterError(JobError):
    """The Trainer is set up in a way the adapter cannot save exactly (says what to change)."""


class ResilientCallback(_callback_base()):
    """Every tier, restore, preemption and SDC check of :class:`resilient.Job` for a Lightning
    ``Trainer`` (see the module docstring).

    - ``run_dir``, ``config``: as for :class:`~resilient.job.Job` (None: ``resilient
      launch``'s, ``$RESILIENT_RUN_DIR`` or ``runs/<script>``; the launch's runtime config or
      the defaults).
    - ``state``, ``rank_state``: more of the run's state (your counters, a data loader
      Lightning does not see), as for the Job.
    - ``replay``: replay a suspect step (where it can be given; module docstring).
    - ``progress``: the Job's progress line (default: only when the Trainer shows no
      progress bar of its own).

    After ``fit``: :attr:`job` (closed) tells what happened (``job.restored``, ``job.step``).
    """

    def __init__(self, run_dir: Any = None, config: Any = None, *, state: Mapping[str, Any] | None = None,
                 rank_state: Mapping[str, Any] | None = None, replay: bool = True, progress: bool | None = None):
        super().__init__()
        self.run_dir, self.config, self.replay, self.progress = run_dir, config, replay, progress
        self.state, self.rank_state = dict(state or {}), dict(rank_state or {})
        self.job: Job | None = None
        self._steps = None          # Job.steps(): driven one step per optimizer step
        self._batch: tuple = ()     # (batch, batch_idx, RNG at its start): what a replay runs again
        self._loss: torch.Tensor | None = None
        self._replaying = False
        self._open = False          # the Job is made and not closed yet

    # ------------------------------------------------------------------ start
    def on_fit_start(self, trainer, pl_module) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise LightningAdapterError(
                f"ResilientCallback saves one optimizer per LightningModule; configure_optimizers() returned "
                f"{len(optimizers)}: combine their parameter groups into one optimizer")
        if getattr(trainer, "ckpt_path", None):
            raise LightningAdapterError(
                f"fit(ckpt_path={trainer.ckpt_path!r}) with ResilientCallback: the callback restores from its own "
                "run dir. To start from a Lightning checkpoint, load its weights into the module before fit "
                "(LightningModule.load_from_checkpoint) and give the callback a fresh run_dir")
        trainer_state, rank = TrainerState(trainer), RankState(trainer)
        taken = {"lightning"} & (set(self.state) | set(self.rank_state))
        if taken:
            raise LightningAdapterError(f"state key(s) {sorted(taken)} are the adapter's own: rename them")
        previous = signal.getsignal(signal.SIGTERM)
        # The strategy's model: DDP's wrapper gets the replica checks (its state names are the module's).
        self.job = job = Job(trainer.strategy.model, optimizers[0], state={"lightning": trainer_state, **self.state},
                             rank_state={"lightning": rank, **self.rank_state}, run_dir=self.run_dir,
                             config=self.config, progress=self._progress(trainer),
                             options=JobOptions(describe={"trainer": "lightning"}))
        self._open, self._batch, self._loss = True, (), None
        if previous is not None and threading.current_thread() is threading.main_thread():
            # Lightning owns SIGTERM (its notice is shared across ranks, and its teardown puts
            # back the handler it found: the Job's would outlive the Job). Ours is read from
            # trainer.received_sigterm at the step boundary instead.
            signal.signal(signal.SIGTERM, previous)
        job.restore()
        apply_restored(trainer, trainer_state, rank)
        if trainer.global_step != job.step:
            raise LightningAdapterError(
                f"restored version {job.step} but Lightning's loop says global step {trainer.global_step}: the "
                f"run dir {job.run_dir} holds another loop's versions; give this run its own run_dir")
        total = trainer.estimated_stepping_batches    # after the restore: it may set up the data
        # Lightning decides when the fit ends (max_steps, max_epochs, early stopping): the Job's
        # count is unbounded, and the fit's end or a preemption ends it.
        self._steps = job.steps(sys.maxsize, total=int(total) if 0 < total < float("inf") else None)
        next(self._steps)   # the run_start event; the first step's checks begin

    def _progress(self, trainer) -> bool:
        if self.progress is not None:
            return self.progress
        return getattr(trainer, "progress_bar_callback", None) is None

    # ----------------------------------------------------------- each step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._steps is None:
            return
        if self._replayable(trainer):
            self._batch = (batch, batch_idx, rng_state())

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._steps is None or self._replaying:
            return
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss   # the micro-batches' sum

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._steps is None:
            return
        replay = (lambda: self._replay(trainer, optimizer)) if self._batch else None
        try:
            ok = self.job.verify(self._loss, replay=replay)
        except SdcError as e:
            if replay is not None:
                raise
            raise SdcError(f"{e}. Under Lightning a replay needs automatic optimization, no gradient "
                           "accumulation and no grad scaler: this run has one of them") from e
        if not ok:
            raise SdcRollback(f"the SDC checks rolled the state back to step {self.job.step} (its last verified "
                              "version): run the fit again to resume from there")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._steps is None:
            return
        stepped = trainer.global_step - self.job.step
        if stepped == 0:
            return   # accumulating gradients: no optimizer step in this batch
        if stepped != 1:
            raise LightningAdapterError(
                f"{stepped} optimizer steps in one training batch: ResilientCallback counts one per batch "
                "(one optimizer, stepped once per batch)")
        # Preemption: every rank stops at the same step (an all-reduce under DDP).
        stop = bool(trainer.received_sigterm or self.job.stop_requested)
        self.job.stop_requested = trainer.strategy.reduce_boolean_decision(stop, all=False)
        expected = self.job.step + 1
        self._batch, self._loss = (), None
        try:
            step = next(self._steps)   # the step boundary; then the next step begins
        except StopIteration:          # preempted: the step is durable (Job.finish)
            self._steps = None
            trainer.should_stop = True
            return
        if step != expected:
            raise SdcRollback(f"the SDC at-rest checks rolled the state back to step {step}: run the fit "
                              "again to resume from there")

    def _replayable(self, trainer) -> bool:
        """One forward/backward per optimizer step that the callback can run again."""
        return (self.replay and self.job.sdc is not None and trainer.lightning_module.automatic_optimization
                and trainer.accumulate_grad_batches == 1
                and getattr(trainer.precision_plugin, "scaler", None) is None)

    def _replay(self, trainer, optimizer) -> torch.Tensor:
        """The batch's forward and backward again, through the strategy (DDP's gradient
        all-reduce, the precision context) and with the RNG of the batch's start."""
        batch, batch_idx, rng = self._batch
        set_rng_state(rng)
        step_fn = trainer.lightning_module.training_step
        args = (batch, batch_idx) if len(inspect.signature(step_fn).parameters) > 1 else (batch,)
        self._replaying = True
        try:
            with torch.enable_grad():
                out = trainer.strategy.training_step(*args)
                loss = out["loss"] if isinstance(out, Mapping) else out
                trainer.strategy.backward(loss, optimizer)
        finally:
            self._replaying = False
        return loss.detach()

    # -------------------------------------------------------------------- end
    def on_fit_end(self, trainer, pl_module) -> None:
        self._end(failed=False)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        preempted = isinstance(exception, SystemExit) and trainer.received_sigterm
        if preempted and self._steps is not None:
            # SIGTERM seen outside the training batches (validation): the last completed step
            # is what there is to keep.
            self.job.stop_requested = True
        self._end(failed=not preempted)

    def _end(self, failed: bool) -> None:
        job, steps = self.job, self._steps
        if not self._open:
            return
        self._open, self._steps = False, None
        try:
            if steps is not None and not failed:
                job.finish()     # the fit ended: make its last step durable
                steps.close()
        finally:
            job.close(failed=failed)
