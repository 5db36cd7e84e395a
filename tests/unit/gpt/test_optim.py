"""Learning-rate schedule and gradient clipping."""

from __future__ import annotations

import pytest
import torch

from resilient.gpt.config import TrainConfig
from resilient.gpt.optim import clip_grad_norm, lr_at


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
    from resilient.optim_state import init_state

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
    from resilient.optim_state import pack_state

    packed, opt = _adam_run(True)
    plain, _ = _adam_run(False)
    for p, q in zip(packed, plain):
        assert torch.equal(p, q)
    moments = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert len(moments) == 6 and len({v.untyped_storage().data_ptr() for v in moments}) == 1
    assert all(st["step"].dim() == 0 and float(st["step"]) == 4 for st in opt.state.values())  # counters stay apart
    assert pack_state(opt) == 0                        # already packed: nothing to do


def test_pack_state_keeps_values_and_groups_by_dtype():
    from resilient.optim_state import pack_state

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


@pytest.mark.parametrize("kw", [{"fused": True}, {"foreach": True}, {"foreach": False}, {"amsgrad": True, "fused": True}])
def test_prefill_lays_out_the_state_adam_would_create_in_one_buffer(kw):
    from resilient.optim_state import init_state, prefill

    def fresh():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (0,), (4, 4, 2)]]
        return ps, torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], **kw)

    ps, ours = fresh()
    assert prefill(ours) == 4
    init_state(ours, torch.nn.Module())                     # finds the state there and keeps it
    qs, torchs = fresh()
    for group in torchs.param_groups:                       # torch's own lazy initialization
        for q in group["params"]:
            q.grad = torch.zeros_like(q)
        torchs._init_group(group, [], [], [], [], [], [])
    for p, q in zip(ps, qs):
        mine, theirs = ours.state[p], torchs.state[q]
        assert list(mine) == list(theirs)
        for k in mine:
            assert (mine[k].dtype, mine[k].shape, mine[k].device) == (theirs[k].dtype, theirs[k].shape, theirs[k].device), k
            assert torch.equal(mine[k], theirs[k].zero_() if k == "step" else theirs[k]), k
    moments = [v for st in ours.state.values() for v in st.values() if v.dim() and v.numel()]
    assert len({v.untyped_storage().data_ptr() for v in moments}) == 1


def test_prefill_leaves_optimizers_it_cannot_lay_out_to_pack_state():
    from resilient.optim_state import init_state, prefill

    module = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)   # no Adam-style _init_group
    before = [p.detach().clone() for p in module.parameters()]
    assert prefill(opt) == 0 and not opt.state
    init_state(opt, module)                                  # falls back to torch's state-dict path
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters()))   # a zero-gradient step
