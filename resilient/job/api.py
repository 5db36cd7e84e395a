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
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from resilient.contract import said_peer_gone  # noqa: F401 (public: a worker's entry asks it)
from resilient.errors import ResilientError


class JobError(ResilientError):
    """The job API was used in a way that cannot work (says how to fix it)."""


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
