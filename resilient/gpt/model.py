"""A decoder-only GPT: RMSNorm, rotary embeddings, SwiGLU MLP, SDPA attention.

Written so that torch's parallel stack applies without changes to the model:

- Blocks live in an ``nn.ModuleDict`` keyed by their global index (``"7"``),
  so a pipeline stage that keeps layers 4..7 still names them
  ``layers.7.attention.wq.weight``: parameter names are global in every
  layout, which is what snapshots key tensors by.
- Pipeline stages delete what they do not own (``tok_embeddings``, ``norm``,
  ``output`` become ``None``) and :meth:`GPT.forward` skips missing parts, so
  one class serves the first, middle and last stage.
- Attention reshapes with ``-1`` heads, so after tensor parallelism splits
  ``wq/wk/wv`` column-wise each rank computes its own heads unchanged.
- Attention goes through ``scaled_dot_product_attention`` with ``is_causal``
  and no dropout: FlashAttention kernels on GPU, the flash CPU kernel on CPU
  (O(T) memory; dropout would force the O(T²) fallback).

Initialization (:func:`init_parameters`) is deterministic from a seed and
independent of the layout: every parameter is drawn from a generator seeded by
(seed, global name), so a pipeline stage or a shard gets the same values the
full model would.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from resilient.gpt.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16 compute.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim/2), computed in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]); x is (B, T, H, D)."""
    T = x.shape[1]
    c = cos[:T].view(1, T, 1, -1)
    s = sin[:T].view(1, T, 1, -1)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/tp of them.
        q = apply_rope(self.wq(x).view(B, T, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        # Activation checkpointing inside forward (not a wrapper module), so
        # parameter names stay global and identical with it on or off.
        self.checkpoint = False

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it (see :meth:`keep_layers`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Buffers are derived data: not saved in state_dict, rebuilt on load.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def keep_layers(self, first: bool, last: bool, layer_ids: list[int]) -> "GPT":
        """Turn this model into one pipeline stage, in place."""
        for i in list(self.layers.keys()):
            if int(i) not in layer_ids:
                del self.layers[i]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = None
            self.output = None
        return self

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) → logits (B, T, V) for a whole model; a stage maps
        its input activations to its output activations."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h).float()
        return h


def initial_value(cfg: ModelConfig, seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """The full fp32 initial value of parameter ``name``.

    Each parameter draws from its own generator seeded from (seed, global
    name): values do not depend on which other parameters a rank holds, so
    every layout starts from the same model.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight")):
        std /= math.sqrt(2 * cfg.n_layers)  # residual projections scaled by depth
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(model: GPT, seed: int) -> None:
    """Initialize a (possibly sharded, possibly partial) model in place.

    For a DTensor parameter the full value is drawn (one tensor at a time, so
    host memory holds one tensor) and this rank copies in the slice its shard
    covers. Also rebuilds the rotary tables (:func:`init_buffers`).
    """
    for name, p in model.named_parameters():
        value = initial_value(model.cfg, seed, name, p.shape)
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            region = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            p.to_local().copy_(value[region])
        else:
            p.copy_(value)
    init_buffers(model)


def init_buffers(model: GPT) -> None:
    """Rebuild the rotary tables, which ``to_empty`` left garbage (they are in no state dict:
    a restore does not bring them)."""
    cos, sin = rope_tables(model.cfg.head_dim, model.cfg.max_seq_len, model.cfg.rope_theta)
    model.rope_cos = cos.to(model.rope_cos.device)
    model.rope_sin = sin.to(model.rope_sin.device)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; the pipeline schedules call it per micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N for the matmuls plus attention's 12·L·d·T
    (the PaLM appendix B accounting), used for MFU."""
    n = cfg.num_params() - cfg.vocab_size * cfg.dim  # embedding lookup is not a matmul
    return 6 * n + 12 * cfg.n_layers * cfg.dim * seq_len
