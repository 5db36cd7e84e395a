"""Learning-rate schedule and gradient clipping."""

from __future__ import annotations

import torch

from resilient.config import TrainConfig
from resilient.optim import clip_grad_norm, lr_at


def test_warmup_then_cosine():
    cfg = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert lr_at(10, cfg) == 1.0
    assert abs(lr_at(100, cfg) - 0.1) < 1e-12
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_clip_matches_torch_on_one_process():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, qs):
        g = torch.randn_like(p) * 10
        p.grad, q.grad = g.clone(), g.clone()
    ours = clip_grad_norm(ps, 1.0, replicas=1)
    theirs = torch.nn.utils.clip_grad_norm_(qs, 1.0)
    assert torch.allclose(ours, theirs)
    for p, q in zip(ps, qs):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
