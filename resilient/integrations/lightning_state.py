"""What a Lightning ``Trainer`` holds beyond the model and optimizer, as :class:`resilient.Job` state.

Lightning's own checkpoint saves the fit loop's progress (global step, epoch,
batch and scheduler counters; the training data loaders' positions when they
have ``state_dict()``), the LR schedulers and the precision plugin (AMP's grad
scaler). These two ``Stateful`` objects give the same to the Job, so a version
restored from any tier resumes the loop exactly where Lightning's checkpoint
at ``on_train_batch_end`` would have:

- :class:`TrainerState` (the Job's ``state``, saved once for the job): the
  fit loop's progress, the LR schedulers, the precision plugin;
- :class:`RankState` (the Job's ``rank_state``, per rank, restored when the
  world size did not change): the data loaders' positions and numpy's global
  RNG (torch's and Python's travel with every Job).

Only public Lightning API is used: ``fit_loop.state_dict()``/``load_state_dict()``,
``lr_scheduler_configs``, ``precision_plugin.state_dict()``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from resilient.job.api import JobError, rank_state_dicts, restore_rank_state

_LOADERS = "combined_loader"   # where the fit loop keeps its data loaders' states


def to_json(value: Any) -> str:
    """``value`` (JSON with tensors inside, e.g. a sampler's generator state) as one string."""
    return json.dumps(rank_state_dicts({"v": value})["v"])


def from_json(text: str) -> Any:
    box: dict = {"v": None}
    restore_rank_state(box, {"v": json.loads(text)})
    return box["v"]


def _loop_state(trainer) -> dict:
    return trainer.fit_loop.state_dict()


class TrainerState:
    """The fit loop's progress, the LR schedulers and the precision plugin, as one JSON string.

    One string rather than a nested dict: a restore fills the shape the state has at
    start, and the loop's shape grows during a run (its loaders' states appear once the
    data is set up); and a plateau scheduler holds ``inf``, which the snapshot's JSON
    values refuse. A restore only keeps what it read (:attr:`loaded`):
    :func:`apply_restored` hands it to Lightning, which loads a loop's state only before
    the loop runs."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        trainer = self.trainer
        loop = _loop_state(trainer)
        loop["state_dict"] = {k: v for k, v in loop.get("state_dict", {}).items() if k != _LOADERS}
        return {"json": to_json({
            "fit_loop": loop,
            "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "precision": trainer.precision_plugin.state_dict(),
        })}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = from_json(state["json"])


class RankState:
    """This rank's data loader positions (Lightning saves a training loader's
    ``state_dict()`` when it has one: without one a resumed epoch starts its data over,
    as with Lightning's own checkpoints) and numpy's global RNG."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.loaders: list | None = None

    def state_dict(self) -> dict:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return {"loaders": _loop_state(self.trainer).get("state_dict", {}).get(_LOADERS),
                "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}

    def load_state_dict(self, state: dict) -> None:
        self.loaders = state.get("loaders")
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def apply_restored(trainer, state: TrainerState, rank: RankState) -> None:
    """Load a restored version's loop progress, schedulers and precision state into the
    trainer (before its fit loop runs, as Lightning's own ``ckpt_path`` restore does)."""
    saved = state.loaded
    if saved is None:
        return
    schedulers = trainer.lr_scheduler_configs
    if len(schedulers) != len(saved["lr_schedulers"]):
        raise JobError(f"the restored version has {len(saved['lr_schedulers'])} LR scheduler(s), this run "
                       f"{len(schedulers)}: configure_optimizers() must return the same ones as the run that "
                       "saved it, or start with a fresh run dir")
    loop = saved["fit_loop"]
    if rank.loaders is not None:
        loop.setdefault("state_dict", {})[_LOADERS] = rank.loaders
    trainer.fit_loop.load_state_dict(loop)
    for config, sd in zip(schedulers, saved["lr_schedulers"]):
        config.scheduler.load_state_dict(sd)
    if saved["precision"]:
        trainer.precision_plugin.load_state_dict(saved["precision"])
    state.loaded, rank.loaders = None, None
