"""SDC in what the device computes: checksummed Linear GEMMs (resilient.sdc.abft) and
block output ranges (resilient.sdc.activations).

Unit level: each of a Linear's three GEMMs passes its checksum identity clean, in every
dtype, and a corrupted result of each is caught and named. Through the public API
(resilient.Job around a user loop with resilient's GPT, one process): the issue's own
scenario — a bit-30 flip in one element of a feed-forward block's output — and a flip in
one Linear's output are caught in their step, replayed away (transient), and the run
ends bitwise equal to the fault-free one."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.events import read_events
from resilient.sdc.api import SdcConfig
from resilient.sdc.monitor import SdcMonitor


def _model(dtype: torch.dtype, bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 48, bias=bias), torch.nn.GELU(),
                               torch.nn.Linear(48, 16, bias=bias)).to(dtype)


def _step(mon: SdcMonitor, model, x, step: int):
    model(x).square().mean().backward()
    sus = mon._compute_checks(step, judge=True)
    for p in model.parameters():
        p.grad = None
    return sus


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True),
                                        (torch.float16, False), (torch.float64, True)])
def test_each_gemm_passes_clean_and_a_corrupted_one_is_named(dtype, bias):
    model = _model(dtype, bias)
    mon = SdcMonitor(SdcConfig(abft_every=1, activation_every=0))
    mon.watch_compute(model)
    assert mon.gemms.covered == ["0", "2"]
    mon.note_restored(0, model)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 6):   # clean, 3-d input (batch, tokens, features)
        assert _step(mon, model, torch.randn(4, 8, 24, generator=gen).to(dtype), step) == []
    assert 0 < mon.gemms.max_clean_ratio <= 1
    x = torch.randn(4, 8, 24, generator=gen).to(dtype)

    def corrupt_first(t):   # one element ×256: an exponent off by 8, far below the range checks' notice
        t = t.clone()
        with torch.no_grad():   # outside autograd, as a fault is: the backward does not know
            t.view(-1)[5] *= 256
        return t

    # forward: the Linear's output (a hook registered after the checks', prepended: runs first)
    h = model[2].register_forward_hook(lambda m, a, out: corrupt_first(out), prepend=True)
    assert [s.tensor for s in _step(mon, model, x, 6)] == ["2:forward"]
    h.remove()
    # grad-input: what the Linear's backward hands to its input
    h = model[2].register_full_backward_hook(lambda m, gi, go: (corrupt_first(gi[0]),))
    assert [s.tensor for s in _step(mon, model, x, 7)] == ["2:grad_input"]
    h.remove()
    # grad-weight: a gradient hook on the weight that runs before the check's
    model2 = _model(dtype, bias)
    h = model2[0].weight.register_hook(corrupt_first)
    mon2 = SdcMonitor(SdcConfig(abft_every=1, activation_every=0))
    mon2.watch_compute(model2)
    mon2.note_restored(0, model2)
    (sus,) = _step(mon2, model2, x, 1)
    assert (sus.kind, sus.tensor) == ("gemm_mismatch", "0:grad_weight") and sus.evidence["excess"] > 1
    h.remove()


def test_autocast_and_repeated_uses_are_checked_as_computed():
    """bf16 autocast (fp32 weights, bf16 GEMMs) and a Linear used twice in one backward
    (its weight's gradient is the sum of both uses' grad-weight GEMMs)."""
    model = _model(torch.float32, True)
    mon = SdcMonitor(SdcConfig(abft_every=1, activation_every=0))
    mon.watch_compute(model)
    mon.note_restored(0, model)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 4):
        x = torch.randn(16, 24, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean() + model(x * 0.5).float().square().mean()
        loss.backward()
        sus = mon._compute_checks(step, judge=True)
        model.zero_grad(set_to_none=True)
        assert sus == [], sus


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       m=st.integers(1, 64), k=st.integers(1, 96), n=st.integers(1, 96), bias=st.booleans(),
       magnitude=st.sampled_from([1e-4, 1.0, 30.0]))
def test_clean_gemms_never_alarm(seed, dtype, m, k, n, bias, magnitude):
    """The no-false-positive sweep of the bound: any shape, dtype, scale and seed, every GEMM
    of two stacked Linears (forward, grad-input, grad-weight) passes clean."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias), torch.nn.GELU(), torch.nn.Linear(n, 7, bias=bias))
    with torch.no_grad():
        for p_ in model.parameters():
            p_.copy_(torch.randn(p_.shape, generator=gen) * magnitude)
    model = model.to(dtype)
    mon = SdcMonitor(SdcConfig(abft_every=1, activation_every=0))
    mon.watch_compute(model)
    mon.note_restored(0, model)
    x = (torch.randn(m, k, generator=gen) * magnitude).to(dtype).requires_grad_()
    sus = _step(mon, model, x, 1)
    mon.close()
    assert [s for s in sus if not s.harmless] == [], sus


# ---- through the public API: resilient's GPT in a user's loop, one process ---------------

def train(run_dir, steps: int, *sets: str):
    """A user's loop around resilient's GPT (small); returns (parameters, events)."""
    from resilient.gpt.config import ModelConfig
    from resilient.gpt.model import GPT, init_parameters
    from resilient.job import Job, NotUnderAgent
    from resilient.runconfig import load_runtime_config

    cfg = load_runtime_config(None, ["snapshot.durable_every=4", "sdc.abft_every=1", "sdc.activation_every=1", *sets])
    mcfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    model = GPT(mcfg)
    init_parameters(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotUnderAgent)
        job = Job(model, opt, run_dir=run_dir, config=cfg, progress=False)

    def forward_backward(step: int):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        return loss

    try:
        for step in job.steps(steps):
            if not job.verify(forward_backward(step), replay=lambda: forward_backward(step)):
                continue
            opt.step()
            opt.zero_grad()
    finally:
        job.close()
    return [p.detach().clone() for p in model.parameters()], list(read_events(run_dir / "events.jsonl"))


def _of(evs, kind):
    return [e for e in evs if e["event"] == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    params, evs = train(tmp_path_factory.mktemp("clean"), 16)
    assert not _of(evs, "sdc_suspect"), _of(evs, "sdc_suspect")
    return params


@pytest.mark.parametrize("module,bit,kinds", [
    # the scenario: -0.031 → -1e37 in a feed-forward block's output; the GEMM inside
    # computed right, the block's range check sees the exponent jump
    ("layers.1.feed_forward", 30, {"activation_spike"}),
    # a Linear's output off by a factor of 4 (exponent bit 24): within any range, but the
    # GEMM's checksum no longer adds up
    ("layers.1.feed_forward.w2", 24, {"gemm_mismatch"}),
])
def test_a_flip_in_forward_is_caught_in_its_step_and_replayed_away_bitwise(clean, tmp_path, module, bit, kinds):
    flip = f'sdc.inject=[{{target="activation", tensor="{module}", bit={bit}, element=7, rank=0, step=13}}]'
    params, evs = train(tmp_path, 16, flip)
    (injected,) = _of(evs, "fault_injected")
    assert injected["step"] == 13 and injected["old"] != injected["new"]
    suspects = _of(evs, "sdc_suspect")
    assert suspects and {s["step"] for s in suspects} == {13}, suspects
    assert kinds <= {s["kind"] for s in suspects} <= kinds | {"activation_spike", "gemm_mismatch"}, suspects
    assert all(s["suspect_rank"] == 0 and module.rsplit(".", 1)[0] in s["tensor"] for s in suspects)
    assert [(v["suspect_rank"], v["verdict"]) for v in _of(evs, "sdc_verdict")] == [(0, "transient")]
    assert not _of(evs, "rollback")
    assert all(torch.equal(a, b) for a, b in zip(params, clean)), "the replayed run differs from the fault-free run"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("target,tensor,bit", [
    # backward: the gradient a Linear's grad-input GEMM hands to its input, one exponent bit off
    ("activation_grad", "layers.1.feed_forward.w2", 27),
    # backward: a weight gradient as its grad-weight GEMM computed it, before any hook
    ("weight_grad", "layers.0.attention.wq.weight", 24),
])
def test_a_flip_in_backward_is_caught_in_its_step_and_replayed_away_bitwise(clean, tmp_path, target, tensor, bit, seed):
    """At a step and element drawn from ``seed``: caught as that GEMM's mismatch in the step
    it struck, replayed away (transient), bitwise equal to the fault-free run."""
    import random

    rng = random.Random(seed)
    step, element = rng.randrange(11, 16), rng.randrange(0, 256)
    flip = f'sdc.inject=[{{target="{target}", tensor="{tensor}", bit={bit}, element={element}, rank=0, step={step}}}]'
    params, evs = train(tmp_path, 16, flip)
    (injected,) = _of(evs, "fault_injected")
    assert injected["step"] == step and injected["old"] != injected["new"]
    suspects = _of(evs, "sdc_suspect")
    assert suspects and {s["step"] for s in suspects} == {step}, suspects
    gemm = "grad_input" if target == "activation_grad" else "grad_weight"
    module = tensor.removesuffix(".weight")
    assert f"0:{module}:{gemm}" in {s["tensor"] for s in suspects if s["kind"] == "gemm_mismatch"}, suspects
    assert {s["suspect_rank"] for s in suspects} == {0}
    assert [(v["suspect_rank"], v["verdict"]) for v in _of(evs, "sdc_verdict")] == [(0, "transient")]
    assert all(torch.equal(a, b) for a, b in zip(params, clean)), "the replayed run differs from the fault-free run"


def test_a_rounding_sized_mismatch_is_harmless_and_a_larger_one_is_not():
    """bf16 Linear whose output row is one dominant element (100) and a small one: a flip of
    its bit 1 (±1.0) exceeds the row's rounding bound (≈0.78) but is no more than two low bits
    of the largest element can change (4·2⁻⁸·100): harmless. Bit 3 (±4): a real mismatch."""
    lin = torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    x = torch.tensor([[100.0, 0.01, 0.0, 0.0]], dtype=torch.bfloat16, requires_grad=True)

    def mismatch(bit):

        mon = SdcMonitor(SdcConfig(abft_every=1, activation_every=0))
        mon.watch_compute(lin)
        mon.note_restored(0, lin)
        h = lin.register_forward_hook(lambda m, a, out: _flipped(out, bit), prepend=True)
        try:
            lin(x).float().sum().backward()
            return [s for s in mon._compute_checks(1, judge=True) if s.tensor.endswith(":forward")]
        finally:
            h.remove()
            mon.close()

    def _flipped(out, bit):
        from resilient.sdc.inject import flip_bit

        out = out.clone()
        flip_bit(out, 0, bit)
        return out

    assert mismatch(0) == []   # half an ulp of 100: inside the rounding bound
    (small,) = mismatch(1)
    assert small.harmless and small.evidence["dsum"] == 1.0
    (big,) = mismatch(3)
    assert not big.harmless and big.evidence["dsum"] == 4.0


def test_a_low_bit_flip_is_not_acted_on(tmp_path):
    """Through the Job: a flip of bit 0 of a Linear's output is no reason to replay or roll back."""
    flip = 'sdc.inject=[{target="activation", tensor="layers.1.feed_forward.w2", bit=0, element=7, rank=0, step=13}]'
    _, evs = train(tmp_path, 16, flip)
    assert _of(evs, "fault_injected")
    assert all(s["harmless"] for s in _of(evs, "sdc_suspect")), _of(evs, "sdc_suspect")
    assert not _of(evs, "sdc_replay") and not _of(evs, "rollback")


def test_by_default_the_gemm_checks_run_on_sampled_steps_and_find_a_persistent_fault_within_the_bound():
    """No sdc knob but the bound (5 steps, for a short test) and a budget so small that the
    bound decides whatever the measured cost (a loaded host must not move the samples): the GEMM checks are armed on
    the sampled steps only; a device whose grad-weight GEMM goes wrong from step 7 on is
    found at the next sample (step 8: the first came at step 3, then every 5), judged
    persistent on replay, and the rollback goes to the last sample that found every GEMM
    clean (step 3), before the fault."""
    from resilient.sdc.api import Action, Verdict

    model = _model(torch.float32, True)
    mon = SdcMonitor(SdcConfig(abft_max_period=5, abft_budget=1e-9))
    mon.watch_compute(model)
    mon.note_restored(0, model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 24, generator=gen) for _ in range(16)]
    step_of = {"now": 0}

    def bad_device(g):   # the grad-weight GEMM's result, wrong from step 7 on (every pass)
        if step_of["now"] < 7:
            return g
        g = g.clone()
        g.view(-1)[3] *= 256
        return g

    model[0].weight.register_hook(bad_device)
    armed, decision = [], None
    for step in range(1, 16):
        step_of["now"] = step
        armed.append(mon.gemms.armed)
        x = batches[step]
        model(x).square().mean().backward()
        decision = mon.after_backward(step, model, None)
        while decision.action is Action.REPLAY:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            decision = mon.after_replay(step, model, None)
        if decision.action is not Action.CONTINUE:
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.after_optimizer_step(step, model)
    mon.close()
    assert [s for s, on in enumerate(armed, 1) if on] == [3, 8]
    assert step == 8 and decision.action is Action.QUARANTINE and decision.quarantine == [0]
    assert decision.verdicts == {0: Verdict.PERSISTENT}
    assert {s.tensor for s in decision.suspicions} == {"0:grad_weight"}
    assert decision.rollback_to == 3 and mon.gemm_steps.samples == 2


def test_the_gemm_checks_period_follows_the_measured_cost_and_their_knobs():
    """The period follows the budget at the cost a sample measured (agreed: the largest over
    ranks), within the bound; ``abft_every`` N overrides it; both at 0 attach nothing."""
    from resilient.sdc.sampling import SampledSteps

    steps = SampledSteps(0.01, 50, 0.3)
    assert steps.period == 30 and [s for s in range(1, 31) if steps.due(s)] == [30]
    steps.measured(30, 0.12)
    assert steps.period == 12 and steps.next_step == 42 and abs(steps.cost() - 0.01) < 1e-9
    steps.measured(42, 2.0)
    assert steps.period == 50                       # the bound wins over the budget
    model = _model(torch.float32, True)
    default = SdcMonitor(SdcConfig())
    default.note_restored(100)                      # a resumed run: the first sample 3 steps in
    assert default.gemm_steps.period == 30 and [s for s in range(101, 140) if default._gemms_due(s)][:1] == [103]
    every = SdcMonitor(SdcConfig(abft_every=3))
    assert every.gemm_steps is None and [s for s in range(1, 10) if every._gemms_due(s)] == [3, 6, 9]
    off = SdcMonitor(SdcConfig(abft_budget=0))
    off.watch_compute(model)
    assert off.gemms is None and off.describe_sampling() is None
