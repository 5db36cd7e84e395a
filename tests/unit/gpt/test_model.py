"""The GPT: shapes, causality, layout-independent init, pipeline stage split."""

from __future__ import annotations

import torch

from resilient.gpt.config import ModelConfig
from resilient.gpt.model import GPT, cross_entropy, init_parameters

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=32)


def make(seed: int = 0) -> GPT:
    m = GPT(CFG)
    init_parameters(m, seed)
    return m


def test_forward_shape_and_loss():
    m = make()
    x = torch.randint(0, 256, (2, 16))
    logits = m(x)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    loss = cross_entropy(logits, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform at init


def test_attention_is_causal():
    m = make()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    assert torch.equal(m(x)[0, :10], m(y)[0, :10])
    assert not torch.equal(m(x)[0, 10:], m(y)[0, 10:])


def test_init_is_seeded_and_layout_independent():
    a, b, c = make(1), make(1), make(2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p, r), n
    # A pipeline stage holding layers 2-3 gets the full model's values.
    stage = GPT(CFG).keep_layers(first=False, last=True, layer_ids=[2, 3])
    init_parameters(stage, 1)
    full = dict(a.named_parameters())
    for n, p in stage.named_parameters():
        assert torch.equal(p, full[n]), n
    assert sorted(stage.layers.keys()) == ["2", "3"] and stage.tok_embeddings is None


def test_stages_compose_to_the_full_model():
    full = make(3)
    s0 = GPT(CFG).keep_layers(first=True, last=False, layer_ids=[0, 1])
    s1 = GPT(CFG).keep_layers(first=False, last=True, layer_ids=[2, 3])
    init_parameters(s0, 3)
    init_parameters(s1, 3)
    x = torch.randint(0, 256, (2, 8))
    assert torch.allclose(s1(s0(x)), full(x))


def test_activation_checkpointing_same_gradients():
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for ckpt in (False, True):
        m = make(5)
        for blk in m.layers.values():
            blk.checkpoint = ckpt
        cross_entropy(m(x), x).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_param_count_matches_config():
    assert sum(p.numel() for p in make().parameters()) == CFG.num_params()
