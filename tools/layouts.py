"""Which box of each tensor every rank of a (pp, dp, tp) layout holds, for the GPT worker.

Mirrors resilient/gpt/parallel.py (keep the two in step):

- pipeline: ``pp * stages_per_rank`` stages own contiguous layer ranges
  (``stage_layers``); stage ``s`` lives on pp rank ``s % pp`` (loop order);
  the first stage also has ``tok_embeddings``, the last ``norm`` and ``output``.
- tensor parallel (``_apply_tp``): ``attention.wq/wk/wv``, ``feed_forward.w1/w3``
  and ``output`` column-wise = ``Shard(0)`` of the weight; ``attention.wo`` and
  ``feed_forward.w2`` row-wise = ``Shard(1)``; embeddings and norms replicated.
- FSDP2 over dp (``_apply_fsdp``): ``Shard(0)`` of every parameter with
  ``torch.chunk`` sizes; over a tp ``Shard(0)`` it becomes
  ``_StridedShard(0, split_factor=tp)`` (FSDP2's own rule), whose rows are not
  contiguous: a rank can hold several boxes.
- mesh rank order: tp fastest, then dp, then pp.
- optimizer state follows its parameter when it has the parameter's shape
  (``exp_avg``, ``exp_avg_sq``); scalars (``step``) are plain tensors on every
  rank of the stage. It is named ``optim/<param>/<key>`` by the runtime
  (train_state keeps only the per-parameter state) and
  ``optim/state/<param>/<key>`` when a whole ``get_state_dict`` optimizer dict
  was saved; both are recognised (:func:`param_name`).

Boxes come from :func:`resilient.snapshot.boxes.shard_pieces` (torch's own
placement arithmetic), the same function restore uses on live DTensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from resilient.snapshot.api import Manifest
from resilient.snapshot.boxes import Box, shard_pieces

from resilient_tools.errors import LayoutError

COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
           "feed_forward.w1.weight", "feed_forward.w3.weight")
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Target:
    """A (pp, dp, tp) layout; ``world = pp * dp * tp``."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    stages_per_rank: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def as_dict(self) -> dict:
        d = {"pp": self.pp, "dp": self.dp, "tp": self.tp, "world": self.world}
        if self.stages_per_rank != 1:
            d["stages_per_rank"] = self.stages_per_rank
        return d


def parse_target(text: str) -> Target:
    """``"pp=2,dp=3,tp=2"`` (any subset; missing = 1; ``spr``/``stages_per_rank`` too)."""
    keys = {"pp": "pp", "dp": "dp", "tp": "tp", "spr": "stages_per_rank", "stages_per_rank": "stages_per_rank"}
    out: dict[str, int] = {}
    if not text.strip(" ,"):
        raise LayoutError("empty target layout; write e.g. 'pp=2,dp=4,tp=2' (missing = 1; 'dp=1' for one rank)")
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in keys or not v.strip().isdigit() or int(v) < 1:
            raise LayoutError(f"bad target layout item {item!r} in {text!r}; write e.g. 'pp=2,dp=4,tp=2' "
                              "with positive integers")
        out[keys[k.strip()]] = int(v)
    return Target(**out)


@dataclass(frozen=True)
class ModelShape:
    """What of the GPT's config the tools need; ``n_heads`` None when the manifest does not say."""

    n_layers: int
    dim: int | None
    hidden: int | None
    vocab: int | None
    n_heads: int | None

    @property
    def is_gpt(self) -> bool:
        return self.n_layers > 0 or self.dim is not None


def param_name(name: str) -> str | None:
    """The model parameter a tensor belongs to, or None.

    ``model/X`` -> X; optimizer state in either naming: ``optim/X/exp_avg``
    (what the runtime writes) and ``optim/state/X/exp_avg`` (a saved
    ``get_state_dict`` dict). The two are told apart by the number of
    ``/``-separated parts: a key never holds a raw ``/`` (flattening escapes it
    as ``~1``). Deeper or other ``optim/`` names (``param_groups``) are None:
    such tensors are written whole, which is always correct."""
    if name.startswith("model/"):
        return name[len("model/"):]
    parts = name.split("/")
    if parts[0] != "optim":
        return None
    if len(parts) == 4 and parts[1] == "state":
        return parts[2]
    if len(parts) == 3 and parts[1] not in ("state", "param_groups"):
        return parts[1]
    return None


def _find_heads(doc: Any, depth: int = 0) -> int | None:
    """``n_heads`` from a JSON extra that carries the model config (e.g. ``extra.config.model``)."""
    if depth > 4:
        return None
    if isinstance(doc, dict):
        v = doc.get("n_heads")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        for x in doc.values():
            got = _find_heads(x, depth + 1)
            if got:
                return got
    return None


def model_shape(m: Manifest, n_heads: int | None = None) -> ModelShape:
    """The GPT's shape from the tensor shapes (and ``n_heads`` from the manifest's extra if present)."""
    layers, dim, hidden, vocab = -1, None, None, None
    for name, t in m.tensors.items():
        p = param_name(name)
        if p is None or not name.startswith("model/"):
            continue
        hit = _LAYER.match(p)
        if hit:
            layers = max(layers, int(hit.group(1)))
            if hit.group(2) == "feed_forward.w1.weight" and len(t.shape) == 2:
                hidden, dim = t.shape
        elif p in ("tok_embeddings.weight", "output.weight") and len(t.shape) == 2:
            vocab, dim = t.shape
    heads = n_heads or _find_heads(m.extra) or _find_heads(m.values)
    return ModelShape(layers + 1, dim, hidden, vocab, heads)


def check_target(target: Target, shape: ModelShape) -> None:
    """Raise :class:`LayoutError` when the GPT cannot run in ``target`` (the rules of Config.validate_layout)."""
    stages = target.pp * target.stages_per_rank
    if shape.n_layers > 0 and shape.n_layers % stages:
        raise LayoutError(f"{shape.n_layers} layers cannot be split into {stages} pipeline stages "
                          f"(pp={target.pp} x stages_per_rank={target.stages_per_rank}); pick pp dividing "
                          f"{shape.n_layers}")
    if shape.n_layers <= 0 and target.pp > 1:
        raise LayoutError("the checkpoint has no 'layers.N' tensors, so it cannot be split into pipeline stages; "
                          "use pp=1")
    if target.tp > 1:
        for what, val in (("attention heads", shape.n_heads), ("ffn dim", shape.hidden), ("vocab size", shape.vocab),
                          ("model dim (heads unknown: no n_heads in the manifest)",
                           shape.dim if shape.n_heads is None else None)):
            if val is not None and val % target.tp:
                raise LayoutError(f"tp={target.tp} does not divide the {what} ({val}); tensor parallelism splits "
                                  f"it evenly. Pick tp dividing {val}")


def stage_of(param: str | None, shape: ModelShape, target: Target) -> int:
    """Pipeline stage holding ``param`` (stage 0 for anything not of the GPT)."""
    stages = target.pp * target.stages_per_rank
    if param is None or stages == 1:
        return 0
    hit = _LAYER.match(param)
    if hit:
        return int(hit.group(1)) // (shape.n_layers // stages)
    if param.startswith(("norm.", "output.")):
        return stages - 1
    return 0


def tp_placement(param: str | None) -> Any:
    """The tensor-parallel placement of a parameter: Shard(0), Shard(1) or Replicate()."""
    if param is None:
        return Replicate()
    hit = _LAYER.match(param)
    tail = hit.group(2) if hit else param
    if tail in COLWISE or param == "output.weight":
        return Shard(0)
    if tail in ROWWISE:
        return Shard(1)
    return Replicate()


def placements(name: str, shape: tuple[int, ...], target: Target,
               param_shape: tuple[int, ...] | None) -> list | None:
    """(dp, tp) mesh placements of a tensor, or None for a plain tensor (written whole by one rank)."""
    param = param_name(name)
    if param is None or not shape or (param_shape is not None and tuple(shape) != tuple(param_shape)):
        return None
    tp = tp_placement(param) if target.tp > 1 else Replicate()
    if target.dp == 1:
        return None if isinstance(tp, Replicate) else [Replicate(), tp]
    if isinstance(tp, Shard) and tp.dim == 0:
        return [_StridedShard(0, split_factor=target.tp), tp]
    return [Shard(0), tp]


def rank_boxes(name: str, shape: tuple[int, ...], target: Target, model: ModelShape,
               param_shape: tuple[int, ...] | None = None) -> Iterator[tuple[int, Box, bool]]:
    """``(rank, box, primary)`` for every box of ``name`` every target rank holds.

    ``primary`` marks the one replica that writes a box (the first along
    replicated mesh dims; the lowest rank for a plain tensor), so the boxes
    with ``primary`` tile the tensor exactly once. ``param_shape`` is the
    parameter's shape when ``name`` is optimizer state (to tell exp_avg from
    a scalar step)."""
    shape = tuple(shape)
    stage = stage_of(param_name(name), model, target)
    pp_rank = stage % target.pp
    pl = placements(name, shape, target, param_shape if param_shape is not None else shape)
    full = Box((0,) * len(shape), shape)
    if any(s == 0 for s in shape):
        return
    for dp_rank in range(target.dp):
        for tp_rank in range(target.tp):
            rank = target.rank(pp_rank, dp_rank, tp_rank)
            if pl is None:
                yield rank, full, dp_rank == 0 and tp_rank == 0
                continue
            primary = all(c == 0 for c, p in zip((dp_rank, tp_rank), pl) if isinstance(p, Replicate))
            for piece in shard_pieces(shape, (target.dp, target.tp), (dp_rank, tp_rank), pl):
                yield rank, piece.box, primary
