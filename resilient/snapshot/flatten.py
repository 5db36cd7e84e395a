"""Nested state dicts <-> flat ``'/'``-joined global names.

``{"model": {"w": T}, "optim": {"state": {"w": {"exp_avg": T}}}}`` becomes
``model/w`` and ``optim/state/w/exp_avg``. A ``/`` or ``~`` inside a key is
escaped as in JSON pointers (``~1``, ``~0``) so names stay unambiguous.
Leaves that are not tensors are JSON values (``param_groups``, counters);
lists and tuples of tensors are flattened with their indices as keys.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import torch


def escape(key: Any) -> str:
    """One level of a tensor name: ``~`` and ``/`` escaped (JSON-pointer style)."""
    return str(key).replace("~", "~0").replace("/", "~1")


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(x) for x in v)
    return False


def iter_leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield ``(name, value, container, key)`` for every leaf of ``state``.

    ``container[key]`` is where the leaf lives, so restore can assign JSON
    leaves back in place."""
    if isinstance(state, dict):
        items = state.items()
    else:
        items = enumerate(state)
    for key, value in items:
        name = f"{prefix}/{escape(key)}" if prefix else escape(key)
        if isinstance(value, torch.Tensor):
            yield name, value, state, key
        elif isinstance(value, dict) or (isinstance(value, (list, tuple)) and _has_tensor(value)):
            yield from iter_leaves(value, name)
        else:
            yield name, value, state, key


def split_state(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by global name, JSON values by global name). Rejects values JSON can't hold."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for name, value, _, _ in iter_leaves(state):
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise TypeError(f"state entry {name!r} is neither a tensor nor JSON ({e}); "
                                "convert it to a tensor or to plain JSON values") from None
            values[name] = value
    return tensors, values
