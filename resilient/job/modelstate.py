"""A model and its optimizer as snapshot state, through torch's state-dict API.

:class:`ModelState` turns one or more ``(module, optimizer)`` pairs — a plain
module, DDP, FSDP2 (``fully_shard``), DTensor tensor parallel, pipeline stages
(one pair per stage a rank holds) — into the nested dict the snapshot format
stores: ``{"model": {fqn: tensor}, "optim": ...}`` with global parameter names
(torch's ``get_state_dict``; FSDP2/TP shards are DTensors, so a restore can
reshard them to any layout). It also loads a restored dict back.

Why it exists rather than calling ``get_state_dict`` each save:

- a restore needs the optimizer's state to exist before the first step (the
  tensors to restore into): :func:`~resilient.optim_state.init_state` makes it
  (zeros, step 0: a run that never restores is bitwise the same as one without
  snapshots) in one flat buffer, which the SDC at-rest hashes read in one pass;
- ``get_state_dict`` costs more than the capture's copy at small sizes, so the
  dict is built once and reused while its tensors are the same objects;
- a restore into the live storage (FSDP2's sharded parameters, the optimizer's
  state tensors) is already loaded: ``set_state_dict`` would copy everything
  again and rebuild the optimizer state as new tensors, on every restart.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resilient.optim_state import init_state, pack_state
from resilient.sdc.checksums import local as _local
from resilient.snapshot.flatten import iter_leaves


def as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


class ModelState:
    """``modules[i]`` is trained by ``optimizers[i]`` (an optimizer may be None: a model
    without one, e.g. a frozen teacher, is saved alone).

    ``param_groups``: also save the optimizers' ``param_groups`` (learning rates,
    betas: whatever a scheduler changes) as JSON; with several optimizers, one list
    per optimizer. The built-in trainer derives them from its config and the step,
    and saves the per-parameter state alone (``optim/<fqn>/<key>``)."""

    def __init__(self, modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer | None],
                 param_groups: bool = True):
        if len(modules) != len(optimizers):
            raise ValueError(f"{len(modules)} modules but {len(optimizers)} optimizers: pass one optimizer "
                             "per module (None for a module without one)")
        self.modules, self.optimizers, self.param_groups = list(modules), list(optimizers), param_groups
        self._state: dict | None = None
        self._key: tuple = ()

    def materialize(self, fallback: bool = True) -> None:
        """Create every optimizer's state now, as its first step would (step 0), so a restore
        has tensors to fill; idempotent for parameters that have state. ``fallback=False``:
        only where that is exact (torch's Adam family); the others wait for a restore
        (:func:`~resilient.optim_state.init_state`)."""
        for module, opt in zip(self.modules, self.optimizers):
            if opt is not None:
                init_state(opt, module, fallback=fallback)

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def _identity(self) -> tuple:
        """Which tensor objects the state is made of; unchanged between steps (the optimizer
        updates in place); a restore or a new optimizer state changes it."""
        ids = [id(p) for m in self.modules for p in m.parameters()]
        for opt in self.optimizers:
            if opt is not None:
                for st in opt.state.values():
                    ids.extend(id(v) for v in st.values())
        return tuple(ids)

    def state_dict(self) -> dict:
        """``{"model": ..., "optim": ...}``, rebuilt only when its tensors changed."""
        key = self._identity()
        if self._state is None or self._key != key:
            self._state, self._key = self._build(), key
        elif self.param_groups:
            self._refresh_groups()
        return self._state

    def _refresh_groups(self) -> None:
        """The cached ``param_groups`` with the optimizers' current hyperparameters (a scheduler
        changes ``lr`` every step; the tensors are the same objects, the JSON is not)."""
        saved = self._state["optim"]["param_groups"]
        opts = [o for o in self.optimizers if o is not None]
        for opt, groups in zip(opts, [saved] if len(opts) == 1 else saved):
            for live, out in zip(opt.param_groups, groups):
                out.update({k: v for k, v in live.items() if k != "params"})

    def _build(self) -> dict:
        model: dict = {}
        state: dict = {}
        groups: list = []
        for module, opt in zip(self.modules, self.optimizers):
            if opt is None:
                model.update(get_state_dict(module, [])[0])
                continue
            model_sd, optim_sd = get_state_dict(module, opt)
            model.update(model_sd)
            state.update(optim_sd["state"])
            groups.append(optim_sd["param_groups"])
        if not self.param_groups:
            return {"model": model, "optim": state}
        return {"model": model, "optim": {"state": state,
                                          "param_groups": groups[0] if len(groups) == 1 else groups}}

    def in_place(self, state: dict) -> bool:
        """Is every tensor of ``state`` a view of a parameter's or an optimizer state's own
        storage? Then a restore that copied into it has loaded every tensor already."""
        live = set()
        for m in self.modules:
            live.update(_local(p).data_ptr() for p in m.parameters())
        for opt in self.optimizers:
            if opt is not None:
                for st in opt.state.values():
                    live.update(_local(v).data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        tensors = [v for _, v, _, _ in iter_leaves(state["model"]) if isinstance(v, torch.Tensor)]
        per_param = state["optim"]["state"] if self.param_groups else state["optim"]
        for _, v, _, _ in iter_leaves(per_param):
            if not isinstance(v, torch.Tensor):
                return False  # a JSON leaf among the optimizer's tensors: load it properly
            tensors.append(v)
        return all(v.numel() == 0 or _local(v).data_ptr() in live for v in tensors)

    def _apply_groups(self, groups) -> None:
        """Restored hyperparameters (everything but ``params``) into each optimizer's groups;
        JSON made tuples lists: give back the type the optimizer has (Adam's ``betas``)."""
        opts = [o for o in self.optimizers if o is not None]
        per_opt = [groups] if len(opts) == 1 else groups
        for opt, saved in zip(opts, per_opt):
            for live, old in zip(opt.param_groups, saved):
                for k, v in old.items():
                    if k == "params":
                        continue
                    cur = live.get(k)
                    if isinstance(cur, torch.Tensor) and isinstance(v, (int, float)):
                        cur.fill_(v)
                    else:
                        live[k] = tuple(v) if isinstance(cur, tuple) and isinstance(v, list) else v

    @staticmethod
    def _names(module: nn.Module) -> set[str]:
        return set(get_state_dict(module, [])[0])

    def load_state_dict(self, state: dict) -> None:
        """Make a restored ``state`` (as :meth:`state_dict` gave it, filled in) live."""
        if self.param_groups:
            self._apply_groups(state["optim"]["param_groups"])
        if self.in_place(state):
            return
        optim = state["optim"]
        per_param = optim["state"] if self.param_groups else optim
        for module, opt in zip(self.modules, self.optimizers):
            # Several modules (pipeline stages): each takes its own names, which do not overlap.
            # One: all of it (DDP's names in the state dict lack the "module." prefix).
            names = self._names(module) if len(self.modules) > 1 else None
            model_sd = {k: v for k, v in state["model"].items() if names is None or k in names}
            if opt is None:
                set_state_dict(module, [], model_state_dict=model_sd, optim_state_dict={})
                continue
            set_state_dict(module, opt, model_state_dict=model_sd,
                           optim_state_dict={"state": {k: v for k, v in per_param.items()
                                                       if names is None or k in names},
                                             "param_groups": get_state_dict(module, opt)[1]["param_groups"]})
        self._state = None  # set_state_dict may have replaced optimizer state tensors
        for opt in self.optimizers:
            if opt is not None:
                pack_state(opt)  # ... then pack them again
