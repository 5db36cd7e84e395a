"""Optimizer state: materialized up front, in one flat buffer.

A restore needs tensors to fill before the first step, and the SDC monitor
hashes Adam's moments twice a step: one flat buffer per device and dtype makes
that one kernel per pass instead of one per tensor. :func:`init_state` builds
the state straight into that buffer (a worker start, which a recovery waits
for, pays for the zeros once); :func:`pack_state` moves state that exists
already (after torch's ``set_state_dict``) into one.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor


def init_state(opt: torch.optim.Optimizer, module: torch.nn.Module, fallback: bool = True) -> bool:
    """Materialize ``opt``'s state (zeros, step 0) for ``module``'s parameters, so a
    restore has tensors to fill, in one flat buffer (:func:`prefill`, else
    :func:`pack_state`).

    torch's ``get_state_dict`` does this with a zero-gradient optimizer step: a full
    Adam pass over every parameter (measured: 1.4 s for a 92M-parameter model on one
    core here), paid at every worker start, which a restart's recovery waits for. Adam's
    own lazy initialization (``_init_group``, given placeholder gradients it does not
    read) creates the same zero tensors without the arithmetic; torch's way stays the
    fallback for an optimizer without it (``fallback``; otherwise such an optimizer is left
    as it is and this returns False). The Adam family's way leaves the step counters at 0
    and every other entry as its own first step would create it, so a run that never
    restores is bitwise identical to one that never took a snapshot; torch's way is not
    (SGD's momentum buffer exists before its first step, which then dampens the gradient):
    use it only for state a restore overwrites anyway.
    """
    prefill(opt)
    try:
        for group in opt.param_groups:
            params = [p for p in group["params"] if p.requires_grad and p.grad is None]
            for p in params:
                p.grad = torch.empty_like(p)
            try:
                opt._init_group(group, [], [], [], [], [], [])
            finally:
                for p in params:
                    p.grad = None
    except (AttributeError, TypeError):  # not torch's Adam family: its own way
        if not fallback:
            return False
        get_state_dict(module, opt)
    for state in opt.state.values():
        if "step" in state:
            state["step"].zero_()
    pack_state(opt)   # whatever prefill could not place (an optimizer it does not know)
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``view`` (shaped like ``p``'s local tensor) as a state entry of ``p``: a DTensor
    with ``p``'s mesh, placements and global shape when ``p`` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return view


def _template(opt: torch.optim.Optimizer, group: dict, like: torch.Tensor) -> dict | None:
    """The state ``opt``'s class gives a fresh parameter of ``like``'s dtype and device,
    learnt on a 2-element probe parameter: ``{key: None}`` for entries shaped like the
    parameter, ``{key: tensor}`` for 0-dim ones (counters). None when anything else
    turns up (an optimizer whose state this cannot lay out)."""
    try:
        q = torch.nn.Parameter(torch.zeros(2, dtype=like.dtype, device=like.device))
        probe = type(opt)([q])   # defaults, then the group's settings (not every key is an argument)
        probe.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        q.grad = torch.zeros_like(q)
        probe._init_group(probe.param_groups[0], [], [], [], [], [], [])
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    out: dict = {}
    for k, v in probe.state[q].items():
        if not isinstance(v, torch.Tensor) or (v.dim() and v.shape != q.shape):
            return None
        if v.dim() and bool(v.count_nonzero()):
            return None   # not zeros (Rprop's step sizes start at lr): the optimizer lays it out itself
        out[k] = None if v.dim() else v
    return out or None


def prefill(opt: torch.optim.Optimizer) -> int:
    """Create the state of every CPU parameter that has none as views of one zeroed
    buffer per dtype, laid out as ``opt``'s own lazy initialization would (keys,
    counters), so that initialization then finds it and keeps it.

    Why not initialize and then :func:`pack_state`: that writes the zeros twice and
    copies them once; measured for a 46M-parameter rank (the ~1 GB bench model, one
    thread, alternating), the worker start's state took 0.66-0.72 s that way against
    0.24-0.30 s unpacked, and 0.24-0.30 s with this. Returns the number of parameters
    filled."""
    todo: dict[tuple, list[tuple[torch.Tensor, dict]]] = {}
    for group in opt.param_groups:
        templates: dict[tuple, dict | None] = {}
        for p in group["params"]:
            loc = _local(p)
            if not p.requires_grad or opt.state.get(p) or loc.device.type != "cpu":
                continue
            key = (loc.dtype, loc.device)
            if key not in templates:
                templates[key] = _template(opt, group, loc)
            if templates[key] is not None:
                todo.setdefault(key, []).append((p, templates[key]))
    filled = 0
    for (dtype, device), items in todo.items():
        total = sum(_local(p).numel() * sum(1 for v in tpl.values() if v is None) for p, tpl in items)
        flat = torch.zeros(total, dtype=dtype, device=device)
        off = 0
        for p, tpl in items:
            loc = _local(p)
            state = {}
            for k, v in tpl.items():
                if v is None:
                    state[k] = _like(flat[off:off + loc.numel()].view(loc.shape), p)
                    off += loc.numel()
                else:
                    state[k] = v.clone()
            opt.state[p] = state
            filled += 1
    return filled


def pack_state(opt: torch.optim.Optimizer) -> int:
    """Move ``opt``'s tensor state (Adam's moments) into one flat buffer per device
    and dtype, each tensor becoming a view of its slice, values unchanged.

    Why: the SDC monitor hashes this state twice a step (after the optimizer
    writes it, and before the next step reads it), and on CPU one reduction over
    a flat buffer costs a quarter of ~100 per-tensor ones (measured in the demo's
    training step: 0.30 vs 1.15 ms for 870k elements). The optimizer updates its
    state in place, so the views stay views. 0-dim tensors (step counters) stay
    as they are. A DTensor's view keeps its mesh, placements and global shape.
    CPU only: packing holds the old and the new copy at once for a moment, which
    an accelerator's memory may not have room for, and there the per-tensor
    kernels are queued asynchronously anyway. Returns the number of tensors packed.

    Caveat (torch 2.13): ``copy.deepcopy`` of packed DTensor state raises
    ("invalid python storage": DTensors sharing one storage); nothing here deep-copies
    it, and torch's ``get_state_dict`` / ``set_state_dict`` handle it. Copy tensors one
    by one instead."""
    slots: dict[tuple, list[tuple[dict, str, torch.Tensor]]] = {}
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() and _local(v).device.type == "cpu":
                slots.setdefault((_local(v).device, v.dtype), []).append((st, k, v))
    packed = 0
    for (device, dtype), items in slots.items():
        locs = [_local(v) for _, _, v in items]
        if len(items) < 2 or _packed(locs):
            continue
        flat = torch.empty(sum(x.numel() for x in locs), dtype=dtype, device=device)
        off = 0
        for (st, k, v), loc in zip(items, locs):
            view = flat[off:off + loc.numel()].view(loc.shape)
            view.copy_(loc)
            off += loc.numel()
            st[k] = _like(view, v)
            packed += 1
    return packed


def _packed(locs: list[torch.Tensor]) -> bool:
    """Do these tensors already tile one storage contiguously, in this order?"""
    first = locs[0]
    if not all(x.is_contiguous() and x.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for x in locs):
        return False
    off = first.storage_offset()
    for x in locs:
        if x.storage_offset() != off:
            return False
        off += x.numel()
    return True


