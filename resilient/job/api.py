"""The public API's types: typed errors, ``Stateful``, per-rank state as JSON.

The launcher (``resilient launch``) tells a worker where it is through its
environment (:mod:`resilient.contract`); a worker started some other way (plain
``torchrun``, ``python``) lacks these and :class:`~resilient.job.Job` falls back to
the durable tier:

``RESILIENT_RUN_DIR``          the run dir (events, checkpoints)
``RESILIENT_NODE_ID``          this node's id (``--node-id``)
``RESILIENT_RUNTIME_CONFIG``   the resolved runtime config, JSON (:mod:`resilient.runconfig`)
``RESILIENT_STORE``            the node store (:class:`~resilient.snapshot.tiers.StoreInfo`)
``RESILIENT_HEARTBEAT_FILE``   the file whose mtime is this worker's heartbeat
``RESILIENT_WORKER_HOOKS``     ``module:attr`` callables given the Job at start (the
                               extension point the chaos harness uses)
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from resilient.contract import said_peer_gone  # noqa: F401 (public: a worker's entry asks it)
from resilient.errors import ResilientError


class JobError(ResilientError):
    """The job API was used in a way that cannot work (says how to fix it)."""


@dataclass(frozen=True)
class JobOptions:
    """What a trainer that knows more than a plain loop tells :class:`~resilient.job.Job`
    (``Job(..., options=JobOptions(...))``). The built-in GPT passes these; nothing here is
    private to it, and a loop that knows none of it passes nothing.

    What each version holds, and how a restore treats it:

    - ``layout``: the parallel layout, stored in every manifest (default ``{"world": N}``);
    - ``config_digest``: the model config's digest: a restore refuses another model's versions;
    - ``run_info(step)``: global JSON saved with each version;
    - ``generators``: named ``torch.Generator`` s whose states are saved per rank;
    - ``param_groups``: save the optimizers' param groups (False: the trainer sets its
      hyperparameters itself, from its config and the step);
    - ``fresh_model``: the model was built uninitialized: restore straight into it;
    - ``reinit()``: re-initialize the model when a rollback finds no version (by default a
      fresh run saves its initial state instead).

    What the SDC checks need to know of the model's parallelism
    (:class:`~resilient.job.guard.SdcGuard`): ``watch_fsdp`` (check FSDP2's gradient
    reductions; default: when there are several ranks), ``post_scale`` (what a pipeline
    schedule multiplies the reduced gradients by).

    Where this rank runs, and what it reports: ``node`` (default ``$RESILIENT_NODE_ID``),
    ``device`` (default: the first parameter's), ``log_every`` (the progress line's
    interval in steps), ``describe`` (fields of the ``run_start`` event), ``startup``
    (seconds per phase the trainer timed before the Job, e.g. with
    :class:`~resilient.progress.Marks`: they lead ``run_start``'s ``startup``).
    """

    layout: Mapping[str, Any] | None = None
    config_digest: str = ""
    run_info: Callable[[int], dict] | None = None
    generators: Mapping[str, torch.Generator] | None = None
    param_groups: bool = True
    fresh_model: bool = False
    reinit: Callable[[], None] | None = None
    watch_fsdp: bool | None = None
    post_scale: float = 1.0
    node: str | None = None
    device: torch.device | None = None
    log_every: int = 1
    describe: Mapping[str, Any] | None = None
    startup: Mapping[str, float] | None = None


def refuse_moved_options(moved: Mapping[str, Any]) -> None:
    """``Job(layout=...)`` and the other keywords that moved into :class:`JobOptions` (before
    issue 40 ``Job`` took 20 parameters): a :class:`JobError` naming the replacement."""
    if not moved:
        return
    known = {f.name for f in fields(JobOptions)}
    unknown = sorted(set(moved) - known)
    if unknown:
        raise TypeError(f"Job() got unexpected keyword argument(s) {unknown}")
    args = ", ".join(f"{k}=..." for k in sorted(moved))
    raise JobError(f"Job({args}): these are options now: pass Job(..., options=resilient.JobOptions({args}))")


class NotUnderAgent(UserWarning):
    """Warned once when a script using the API runs without ``resilient launch``."""

    MESSAGE = ("resilient: not started by `resilient launch`: snapshots go to the durable tier only "
               "({run_dir}/checkpoints); no node-RAM or peer copies, no heartbeat supervision, no quarantine. "
               "Run it as `resilient launch [--nproc-per-node N] SCRIPT ARGS` for every tier.")


@runtime_checkable
class Stateful(Protocol):
    """What torch.distributed.checkpoint calls ``Stateful``: an LR scheduler, a
    ``torchdata`` ``StatefulDataLoader``, an object of your own."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


def is_stateful(obj: Any) -> bool:
    return not isinstance(obj, (dict, torch.Tensor)) and isinstance(obj, Stateful)


# Per-rank state travels as JSON in the snapshot's per-rank extra; a tensor inside it (a
# sampler's generator state) is written as base64 of its bytes with its dtype and shape.
_TENSOR = "__tensor__"


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {_TENSOR: base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode(),
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            raw = bytearray(base64.b64decode(value[_TENSOR]))
            dtype = getattr(torch, value["dtype"])
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(value["shape"]).clone() if raw \
                else torch.empty(value["shape"], dtype=dtype)
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def rank_state_dicts(rank_state: Mapping[str, Any]) -> dict:
    """This rank's state as JSON: ``state_dict()`` of each Stateful, the value otherwise."""
    return {k: _encode(v.state_dict() if is_stateful(v) else v) for k, v in rank_state.items()}


def restore_rank_state(rank_state: dict, saved: Mapping[str, Any]) -> None:
    """Load what :func:`rank_state_dicts` saved back: ``load_state_dict`` of each Stateful;
    a dict is updated in place (the script holds it), anything else replaced."""
    for k, v in saved.items():
        if k not in rank_state:
            continue
        value = _decode(v)
        target = rank_state[k]
        if is_stateful(target):
            target.load_state_dict(value)
        elif isinstance(target, dict) and isinstance(value, dict):
            target.clear()
            target.update(value)
        else:
            rank_state[k] = value
