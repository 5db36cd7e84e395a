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


def _adam_run(packed: bool) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    from resilient.optim import init_state

    torch.manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (4, 4, 2)]]
    opt = torch.optim.AdamW(ps, lr=1e-2)
    if packed:
        init_state(opt, torch.nn.Module())
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return ps, opt


def test_packed_optimizer_state_is_one_buffer_and_trains_bitwise_the_same():
    from resilient.optim import pack_state

    packed, opt = _adam_run(True)
    plain, _ = _adam_run(False)
    for p, q in zip(packed, plain):
        assert torch.equal(p, q)
    moments = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert len(moments) == 6 and len({v.untyped_storage().data_ptr() for v in moments}) == 1
    assert all(st["step"].dim() == 0 and float(st["step"]) == 4 for st in opt.state.values())  # counters stay apart
    assert pack_state(opt) == 0                        # already packed: nothing to do


def test_pack_state_keeps_values_and_groups_by_dtype():
    from resilient.optim import pack_state

    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64))
    c = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([a, b, c], lr=0.1)
    opt.state[a] = {"m": torch.randn(3)}
    opt.state[b] = {"m": torch.randn(2, 2, dtype=torch.float64)}
    opt.state[c] = {"m": torch.randn(4), "n": 7}
    before = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()} for p in (a, b, c)}
    assert pack_state(opt) == 2                        # the two float32 moments; float64 alone stays
    for p in (a, b, c):
        for k, v in opt.state[p].items():
            assert torch.equal(v, before[id(p)][k]) if isinstance(v, torch.Tensor) else v == before[id(p)][k]
    assert opt.state[a]["m"].untyped_storage().data_ptr() == opt.state[c]["m"].untyped_storage().data_ptr()
