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
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resilient.config import Config
from resilient.events import EventLog
from resilient.optim import Optimizers
from resilient.parallel import ParallelModel
from resilient.snapshot import Restored, Snapshotter, rng_state, set_rng_state


def durable_url(cfg: Config, run_dir: Path) -> str:
    return cfg.snapshot.durable_url or (run_dir / "checkpoints").as_uri()


def init_optimizer_state(model: ParallelModel, optimizers: Optimizers) -> None:
    """Materialize AdamW's state (zeros) so a restore has tensors to fill.

    torch's ``get_state_dict`` does this with a zero-gradient step, which also
    advances AdamW's step counter to 1; set it back to 0, so a run that never
    restores is bitwise identical to one that never took a snapshot.
    """
    for part, opt in zip(model.parts, optimizers.optimizers):
        get_state_dict(part, opt)
        for state in opt.state.values():
            if "step" in state:
                state["step"].zero_()


class TrainState:
    def __init__(self, cfg: Config, run_dir: Path, model: ParallelModel, optimizer: Optimizers,
                 events: EventLog):
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.events = events
        init_optimizer_state(model, optimizer)
        snap = cfg.snapshot
        self.durable: Snapshotter | None = None
        self.last_saved = -1
        if snap.durable_every or snap.durable_seconds or snap.resume:
            self.durable = Snapshotter.from_config(
                snap, durable_url(cfg, run_dir), events=events, layout=model.layout.as_dict(),
                config_digest=cfg.digest())

    def state(self) -> dict:
        """Global names throughout: the stage modules' names do not overlap."""
        state: dict = {"model": {}, "optim": {}}
        for part, opt in zip(self.model.parts, self.optimizer.optimizers):
            model_sd, optim_sd = get_state_dict(part, opt)
            state["model"].update(model_sd)
            # Only the per-parameter state: hyperparameters (param_groups) come
            # from the config and the step, whatever layout wrote the snapshot.
            state["optim"].update(optim_sd["state"])
        return state

    def restore(self) -> Restored | None:
        """Load the newest complete version into the model and optimizer, in
        place, resharded to this layout. Returns None on a fresh run."""
        if self.durable is None or not self.cfg.snapshot.resume:
            return None
        state = self.state()
        restored = self.durable.restore(state)
        if restored is None:
            return None
        for part, opt in zip(self.model.parts, self.optimizer.optimizers):
            names = {n for n, _ in part.named_parameters()}
            groups = get_state_dict(part, opt)[1]["param_groups"]
            set_state_dict(part, opt,
                           model_state_dict={k: v for k, v in state["model"].items() if k in names},
                           optim_state_dict={"state": {k: v for k, v in state["optim"].items() if k in names},
                                             "param_groups": groups})
        if restored.extra is not None:
            set_rng_state(restored.extra["rng"])
        return restored

    def after_step(self, step: int, force: bool = False) -> None:
        """Called after optimizer step ``step`` (completed steps): capture if due."""
        if self.durable is not None and step != self.last_saved and (force or self.durable.due(step)):
            self.durable.save(step, self.state(), extra={"rng": rng_state()},
                              global_extra={"step": step, "sample_index": step * self.cfg.train.global_batch},
                              force=True)
            self.last_saved = step

    def final(self, step: int, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Make sure ``step`` is durable before the process ends (end of run, preemption)."""
        if self.durable is None:
            return
        self.after_step(step, force=True)
        self.durable.wait(timeout)

    def close(self) -> None:
        if self.durable is not None:
            self.durable.close()
