"""Single-process tests of the SDC building blocks: bit flips, checksums, the
derived rounding bound of the linear check, robust spikes, replay verdicts."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.sdc.api import SdcConfig, SdcError, Verdict
from resilient.sdc.checksums import BITS, RobustSpike, bitsum, compare_replicas, stats, unit_roundoff
from resilient.sdc.inject import BitFlipInjector, FlipSpec, flip_bit
from resilient.sdc.reduction import linear_bound
from resilient.sdc.replay import Match, ReplayStateMachine, State, classify, compare, fingerprint, replay_step


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


@pytest.mark.parametrize("bit", [0, 1, 12, 22, 23, 27, 30, 31])
def test_flip_bit_fp32_is_exact(bit):
    t = torch.tensor([1.5, -0.375, 3.0e-3], dtype=torch.float32)
    old, new = flip_bit(t, 1, bit)
    assert old == -0.375
    assert _f32_bits(new) == _f32_bits(-0.375) ^ (1 << bit)
    assert t[0] == 1.5 and t[2] == torch.tensor(3.0e-3)          # neighbours untouched
    flip_bit(t, 1, bit)
    assert t[1] == -0.375                                          # a flip is its own inverse


def test_flip_bit_bf16_sign_exponent_mantissa():
    t = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert flip_bit(t, 0, 15) == (1.0, -1.0)                       # sign
    assert flip_bit(t, 1, 7)[1] == 4.0                             # lowest exponent bit: 2 -> 4
    assert flip_bit(t, 1, 6)[1] == 6.0                             # top mantissa bit: 4 -> 6
    with pytest.raises(SdcError):
        flip_bit(t, 0, 16)
    with pytest.raises(SdcError):
        flip_bit(t, 5, 0)


def test_flip_bit_on_dtensor_local_shard():
    # a DTensor on a 1-rank mesh in-process: flip_bit must hit the local shard in place
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from resilient.sdc.harness import free_port
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        old, new = flip_bit(d, 5, 31)
        assert (old, new) == (1.0, -1.0)
        assert d.to_local().reshape(-1)[5] == -1.0 and d.full_tensor().sum() == 10.0
    finally:
        dist.destroy_process_group()


def test_injector_transient_fires_once_persistent_every_step():
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.fill_(1.0)
    once = BitFlipInjector(FlipSpec("param", "weight", bit=31, rank=0, step=2), rank=0)
    assert once.maybe_inject(1, m) is None
    assert once.maybe_inject(2, m)["new"] == -1.0
    assert once.maybe_inject(2, m) is None                          # not again on replay
    always = BitFlipInjector(FlipSpec("param", "weight", bit=31, rank=0, step=2, persistent=True), rank=0)
    assert always.maybe_inject(2, m) and always.maybe_inject(2, m) and always.maybe_inject(3, m)
    other = BitFlipInjector(FlipSpec("param", "weight", bit=31, rank=1, step=0), rank=0)
    assert other.maybe_inject(0, m) is None                         # another rank's fault
    with pytest.raises(SdcError):
        FlipSpec.from_dict({"target": "weights", "tensor": "w", "bit": 1})


def test_injector_pinned_to_a_node_follows_the_device_not_the_rank():
    """A bad device stays bad whichever rank it gets; the rank it had goes to healthy hardware."""
    m = torch.nn.Linear(3, 2)
    spec = FlipSpec.from_dict({"target": "param", "tensor": "weight", "bit": 31, "node": "b", "step": 0,
                               "persistent": True})
    on_b = BitFlipInjector(spec, rank=0, node="b", local_rank=0)      # b now holds rank 0
    rec = on_b.maybe_inject(0, m)
    assert rec and rec["device"] == "b:0" and rec["rank"] == 0
    assert BitFlipInjector(spec, rank=1, node="c", local_rank=0).maybe_inject(0, m) is None   # the spare: healthy
    assert BitFlipInjector(spec, rank=1, node="b", local_rank=1).maybe_inject(0, m) is None   # b's other device
    with pytest.raises(SdcError):
        FlipSpec.from_dict({"target": "param", "tensor": "weight", "bit": 31, "node": 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bit", [0, 1, 2, 6, 7, 14, 15])
def test_at_rest_bitsum_delta_names_the_flipped_bit_and_only_bits_0_1_are_harmless(dtype, bit):
    from resilient.sdc.checksums import harmless_bound
    from resilient.sdc.monitor import at_rest_delta

    torch.manual_seed(bit)
    t = torch.randn(1000).to(dtype)
    before = int(bitsum(t))
    old, new = flip_bit(t, 123, bit)
    delta, harmless = at_rest_delta(int(bitsum(t)) - before)
    assert abs(delta) == (1 << bit)
    assert harmless == (bit <= 1)
    if harmless:   # agrees with the value-based bound
        assert abs(new - old) <= harmless_bound(dtype, float(t.abs().max()), float(t.abs().sum()), t.numel())


def test_injector_optimizer_state_and_activation():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    inj = BitFlipInjector(FlipSpec("optim_state", "0.weight", bit=30, step=1, element=3), rank=0)
    before = opt.state[m[0].weight]["exp_avg"].reshape(-1)[3].item()
    rec = inj.maybe_inject(1, m, opt)
    assert rec["old"] == before and opt.state[m[0].weight]["exp_avg"].reshape(-1)[3].item() == rec["new"] != before
    act = BitFlipInjector(FlipSpec("activation", "0", bit=31, step=4, element=0), rank=0)
    act.attach(m)
    x = torch.randn(2, 3)
    act.current_step = 3
    clean = m(x)
    act.current_step = 4
    assert not torch.equal(m(x), clean) and act.fired == 1
    assert torch.equal(m(x), clean)                                 # transient: once
    act.detach()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), bit=st.integers(0, 31), seed=st.integers(0, 10 ** 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_every_single_bit_flip_changes_the_bitsum(n, bit, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 10 ** torch.randint(-6, 6, (1,), generator=g).item()).to(dtype)
    bit = bit % (x.element_size() * 8)
    y = x.clone()
    flip_bit(y, int(torch.randint(0, n, (1,), generator=g)), bit)
    assert bitsum(x) != bitsum(y)
    sx, sy = stats([x]), stats([y])
    assert sx[0, BITS].view(torch.int64) != sy[0, BITS].view(torch.int64)


def _simulated_reduce_scatter(xs: list[torch.Tensor], red: torch.dtype, orig: torch.dtype, average: bool,
                              g: torch.Generator) -> torch.Tensor:
    """Reduce the ranks' inputs elementwise in ``red`` arithmetic, in a random rank
    order per call (any ring/tree order), then divide and cast like FSDP does."""
    order = torch.randperm(len(xs), generator=g).tolist()
    acc = xs[order[0]].to(red).clone()
    for k in order[1:]:
        acc = acc + xs[k].to(red)          # one rounding in the reduce dtype per addition
    if average:
        acc = acc / len(xs)
    return acc.to(orig)


@settings(max_examples=80, deadline=None)
@given(world=st.integers(2, 8), m=st.integers(1, 4000), seed=st.integers(0, 10 ** 6),
       dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]),
       average=st.booleans(), heavy=st.booleans(), calls=st.integers(1, 3))
def test_linear_bound_holds_on_clean_reductions(world, m, seed, dtypes, average, heavy, calls):
    """The derived bound (safety 1) is never exceeded by honest arithmetic: no false positives."""
    red, orig = dtypes
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(m, dtype=orig)
    sum_in = l1_in = 0.0
    for _ in range(calls):               # gradient accumulation into .grad
        xs = []
        for _k in range(world):
            x = torch.randn(m, generator=g)
            if heavy:                    # gradients are heavy-tailed; mix scales over 8 decades
                x = x * torch.exp(torch.randn(m, generator=g) * 4)
            xs.append(x.to(red))
        sum_in += sum(float(x.double().sum()) for x in xs)
        l1_in += sum(float(x.double().abs().sum()) for x in xs)
        out = (out.to(torch.float32) + _simulated_reduce_scatter(xs, red, orig, average, g).to(torch.float32)).to(orig) \
            if calls > 1 else _simulated_reduce_scatter(xs, red, orig, average, g)
    scale = 1 / world if average else 1.0
    ops = (world - 1) + (1 if average else 0) + (calls - 1) + (1 if red != orig else 0)
    u = max(unit_roundoff(red), unit_roundoff(orig))
    err = abs(float(out.double().sum()) - scale * sum_in)
    assert err <= linear_bound(ops, u, scale, l1_in, m * world * calls, safety=1.0), (err, ops)


@pytest.mark.parametrize("bit", [31, 30, 23, 22])
def test_linear_check_catches_high_flips_of_a_median_element(bit):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(20000, generator=g) for _ in range(4)]
    out = _simulated_reduce_scatter(xs, torch.float32, torch.float32, True, g)
    i = int(out.abs().argsort()[out.numel() // 2])
    flip_bit(out, i, bit)
    l1 = sum(float(x.double().abs().sum()) for x in xs)
    err = abs(float(out.double().sum()) - sum(float(x.double().sum()) for x in xs) / 4)
    assert err > linear_bound(4, unit_roundoff(torch.float32), 0.25, l1, 80000, safety=2.0)


def test_compare_replicas_without_process_group_is_quiet():
    assert compare_replicas([("w", torch.ones(3))], None, step=0) == []


def test_robust_spike_flags_outliers_and_ignores_noise():
    det = RobustSpike(k=12, window=50, warmup=10)
    g = torch.Generator().manual_seed(0)
    noise = (2.0 + 0.05 * torch.randn(200, generator=g)).tolist()
    assert not any(det.check(v)[0] for v in noise)
    assert det.check(2.0 + 50 * 0.05)[0]                            # a 50-sigma jump
    assert det.check(math.nan) == (False, math.nan) or math.isnan(det.check(math.nan)[1])
    assert not det.check(2.01)[0]                                   # the spike did not raise the bar


def test_classify_table():
    assert classify(Match.SAME, still_suspect=True) is Verdict.PERSISTENT
    assert classify(Match.DIFFERENT, still_suspect=True) is Verdict.PERSISTENT
    assert classify(Match.SAME, still_suspect=False) is Verdict.FALSE_ALARM
    assert classify(Match.DIFFERENT, still_suspect=False) is Verdict.TRANSIENT
    assert classify(Match.ROUNDING, still_suspect=False) is Verdict.HARMLESS


def test_state_machine_escalates_repeated_transients():
    sm = ReplayStateMachine(max_transients=2)
    for i, want in enumerate([Verdict.TRANSIENT, Verdict.PERSISTENT]):
        sm.suspect(i, [], {})
        sm.begin()
        assert sm.state is State.REPLAYING
        assert sm.conclude({3: (Match.DIFFERENT, False)}, {3: "h:cuda:3"}) == {3: want}
        assert sm.state is State.IDLE
    with pytest.raises(SdcError):
        sm.conclude({}, {})


def _step_grads(model, x, injector, step):
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    if injector is not None:
        injector.maybe_inject(step, model)
    return fingerprint((n, p.grad) for n, p in model.named_parameters())


@pytest.mark.parametrize("persistent,bit,want", [(False, 30, Verdict.TRANSIENT), (True, 30, Verdict.PERSISTENT),
                                                 (False, 0, Verdict.HARMLESS)])
def test_replay_step_classifies_with_a_real_recompute(persistent, bit, want):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(32, 8)
    reference = _step_grads(model, x, None, 0)           # a healthy replica's answer
    inj = BitFlipInjector(FlipSpec("grad", "0.weight", bit=bit, step=5, element=7, persistent=persistent), rank=0)
    original = _step_grads(model, x, inj, 5)
    assert compare(original, reference)[0] is not Match.SAME

    def check(fp):  # the exact check: agree bitwise with the healthy replica
        return compare(fp, reference)[0] is Match.SAME

    verdict, replayed, _ = replay_step(original, lambda: _step_grads(model, x, inj, 5), check)
    assert verdict is want


def test_sdc_config_loads_from_a_toml_table():
    from resilient.configbase import explain, load_section
    cfg = load_section(SdcConfig, {"check_every": 2, "probe_dtypes": ["float32"]}, "sdc", "x.toml")
    assert cfg.check_every == 2 and list(cfg.probe_dtypes) == ["float32"]
    assert any(line.startswith("sdc.loss_spike_k") for line in explain(SdcConfig, "sdc."))


def test_grad_spike_floor_spares_natural_jumps_and_catches_exponent_flips():
    det = RobustSpike(k=50, window=50, warmup=10, min_sigma=0.1)
    for i in range(30):
        assert not det.check(math.log(100.0 * (1 + 0.01 * (i % 3))))[0]
    assert not det.check(math.log(300.0))[0]            # a hard batch: 3x
    assert det.check(math.log(100.0 * 2.0 ** 64))[0]    # a flipped exponent bit


def test_bitsums_plan_matches_per_tensor_bitsums_with_scalars_and_mixed_dtypes():
    from resilient.sdc.atrest import BitSums

    torch.manual_seed(0)
    ts = [torch.randn(7), torch.tensor(3.0), torch.randn(3, 4).bfloat16(), torch.tensor(7.0),
          torch.tensor(2.5, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)]
    plan = BitSums(ts)
    assert sorted(plan.entries) == [(i,) for i in range(len(ts))]   # nothing packed: one entry per tensor
    by_tensor = lambda: {e[0]: v for e, v in zip(plan.entries, plan().tolist())}   # noqa: E731
    assert by_tensor() == {i: int(bitsum(t)) for i, t in enumerate(ts)}
    ts[3].add_(1)                                    # updated in place: the plan still applies
    assert plan.same(ts) and by_tensor() == {i: int(bitsum(t)) for i, t in enumerate(ts)}
    assert not plan.same(ts[:-1] + [torch.randn(2, 2, dtype=torch.float64)])


def test_bitsums_of_a_packed_run_are_piece_sums_that_name_the_tensor_struck():
    """A packed run is summed in pieces cut at every BLOCK and at every tensor's boundary:
    a flip is reported in the tensor it struck, not in its neighbour that shares a block
    (an exp_avg_sq flip was once named as the exp_avg before it). Same answers with the
    C kernel and without it."""
    from resilient.sdc.atrest import BLOCK, AtRest, BitSums

    torch.manual_seed(2)
    flat = torch.randn(3 * BLOCK + 100)
    a, b, c = flat[:BLOCK + 50], flat[BLOCK + 50:3 * BLOCK].view(2, -1), flat[3 * BLOCK:]
    ts = [torch.tensor(1.0), c, torch.randn(5), a, b]          # list order is not storage order
    plan = BitSums(ts)
    assert [e for e in plan.entries if e[0] in (1, 3, 4)] == [(3,), (3,), (4,), (4,), (1,)]   # pieces of the run
    sums = plan().tolist()
    per = {i: sum(v for e, v in zip(plan.entries, sums) if e == (i,)) % (1 << 32) for i in (1, 3, 4)}
    assert per == {i: int(bitsum(ts[i])) % (1 << 32) for i in (1, 3, 4)}
    if plan.native.ok:   # the torch path gives the same numbers
        plan.native.ok = False
        assert plan().tolist() == sums
        plan.native.ok = True
    rest = AtRest("optim_state_at_rest")
    named = list(zip(["s", "c", "w", "m.exp_avg", "m.exp_avg_sq"], ts))
    rest.record(1, named)
    flip_bit(b, 3, 30)                               # in b, inside the block a and b share
    sus = rest.verify(2, ts, rank=0, device="d")
    assert [(s.tensor, s.harmless) for s in sus] == [("m.exp_avg_sq", False)]
    assert abs(sus[0].evidence["bitsum_delta"]) == 1 << 30
    # two pieces of one tensor moved: a harmless-looking bit-0 flip must not hide a real one
    # (the monitor merges suspicions by name, so they come as one)
    rest.record(3, named)
    flip_bit(b, 5, 0)                                # b's piece of the block shared with a
    flip_bit(b, BLOCK + 7, 30)                       # b's own block
    sus = rest.verify(4, ts, rank=0, device="d")
    assert [(s.tensor, s.harmless) for s in sus] == [("m.exp_avg_sq", False)] and len(sus[0].evidence["bitsum_delta"]) == 2


def test_at_rest_record_catches_every_flip_once_and_names_the_tensor():
    from resilient.sdc.atrest import AtRest

    torch.manual_seed(1)
    named = [("w", torch.randn(64)), ("step", torch.tensor(4.0)), ("m", torch.randn(8, 8))]
    rest = AtRest("optim_state_at_rest")
    rest.record(3, named)
    flip_bit(named[1][1], 0, 23)                     # Adam's step counter: an exponent bit
    flip_bit(named[2][1], 5, 0)                      # the lowest mantissa bit: harmless
    sus = rest.verify(4, [t for _, t in named], rank=1, device="d")
    assert [(s.tensor, s.harmless, s.rank) for s in sus] == [("step", False, 1), ("m", True, 1)]
    assert sus[0].evidence["hashed_after_step"] == 3 and abs(sus[0].evidence["bitsum_delta"]) == 1 << 23
    assert rest.verify(5, [t for _, t in named], rank=1, device="d") == []   # single use
    rest.record(5, named)
    assert rest.verify(6, [t for _, t in named][:2], rank=1, device="d")[0].tensor == "*"   # the set changed


def test_loss_mean_from_the_exchange_counts_only_ranks_that_hold_a_loss():
    from resilient.sdc.monitor import SdcMonitor

    mon = SdcMonitor(SdcConfig(), device="cpu")
    # (loss, has_loss, n_suspicions) per rank: a pipeline's first stage holds none
    mon._note_losses(torch.tensor([[2.5, 1, 0], [0.0, 0, 0], [4.0, 1, 0]], dtype=torch.float64))
    assert mon.loss_mean == 3.25
    mon._note_losses(torch.zeros(3, 3, dtype=torch.float64))
    assert mon.loss_mean is None


def test_resting_state_walk_is_kept_but_follows_a_loaded_state_dict():
    from resilient.sdc.atrest import Resting

    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 2))
    opt = torch.optim.AdamW([a, b])
    named = [("a", a), ("b", b)]
    rest = Resting()
    rest.optimizers = [opt]
    assert rest.state_tensors(named) == []                     # no state before the first step
    a.grad, b.grad = torch.ones(4), torch.ones(2, 2)
    opt.step()
    first = rest.state_tensors(named)
    assert [n for n, _ in first] == ["a.step", "a.exp_avg", "a.exp_avg_sq", "b.step", "b.exp_avg", "b.exp_avg_sq"]
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    opt.load_state_dict(sd)                                     # new tensors in a new mapping
    again = rest.state_tensors(named)
    assert [n for n, _ in again] == [n for n, _ in first]
    assert all(v is opt.state[p][n.split(".")[1]] for (n, v), p in zip(again, [a, a, a, b, b, b]))
    assert not any(v is w for (_, v), (_, w) in zip(again, first))


def test_a_reproducible_nan_is_the_same_answer_not_a_difference():
    """Training instability (a NaN the replay reproduces bit for bit) must not read
    as a bad device: NaN != NaN made every such replay DIFFERENT → persistent."""
    g = torch.tensor([1.0, float("nan"), 3.0])
    match, _ = compare(fingerprint([("g", g)]), fingerprint([("g", g.clone())]))
    assert match is Match.SAME
    other = g.clone()
    other[0] = 2.0
    assert compare(fingerprint([("g", g)]), fingerprint([("g", other)]))[0] is Match.DIFFERENT


def test_state_checks_alone_still_give_a_verified_step():
    """With parameter checks off, a verified optimizer state is what a rollback
    can go back to (was: nothing, so every rollback restarted from scratch)."""
    from resilient.sdc.atrest import Resting

    a = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([a])
    a.grad = torch.ones(4)
    opt.step()
    rest = Resting()
    rest.optimizers = [opt]
    rest.record(7, [("a", a)], params=False, state=True)
    sus, verified = rest.verify(8, [("a", a)], rank=0, device="cpu")
    assert sus == [] and verified == 7


def test_local_gradient_check_sees_nan_and_spikes_without_a_reduction():
    from resilient.sdc.checksums import LocalGradCheck

    chk = LocalGradCheck(k=50.0, window=50, warmup=5)
    rng = torch.Generator().manual_seed(0)
    for step in range(1, 8):
        g = torch.randn(64, generator=rng)
        assert chk.check([g, None], step=step, rank=3, judge=True) == []
    bad = torch.randn(64, generator=rng)
    bad[5] = float("nan")
    (s,) = chk.check([bad], step=8, rank=3, judge=True)
    assert (s.kind, s.rank, s.step) == ("nonfinite", 3, 8)
    huge = torch.randn(64, generator=rng)
    huge[5] = 3.6e33   # bit 30 flipped: finite, far off the band
    (s,) = chk.check([huge], step=9, rank=3, judge=True)
    assert s.kind == "grad_spike"


@pytest.mark.parametrize("spec,words", [
    ({"target": "grad", "bit": 30, "step": 2}, "lacks \\['tensor'\\]"),
    ({"target": "grad", "tensor": "w", "bit": "30"}, "FlipSpec.bit='30': expected int"),
    ({"target": "grad", "tensor": "w", "bit": 30, "rank": -1}, "FlipSpec.rank=-1: must be ≥ 0"),
    ({"target": "grad", "tensor": "w", "bit": 30, "persistent": "yes"}, "expected bool"),
])
def test_a_malformed_inject_spec_is_an_sdc_error(spec, words):
    with pytest.raises(SdcError, match=words):
        FlipSpec.from_dict(spec)


@pytest.mark.parametrize("spec,words", [
    ({"target": "grad", "tensor": "w", "bit": 30, "rank": 7}, "outside the job's 2 ranks"),
    ({"target": "grad", "tensor": "nope", "bit": 30}, "holds no parameter 'nope'"),
    ({"target": "param", "tensor": "w", "bit": 32}, "bit 32 / element 0 outside"),
    ({"target": "param", "tensor": "w", "bit": 3, "element": 12}, "element 12 outside"),
])
def test_an_inject_spec_the_model_cannot_take_is_refused_at_start(spec, words):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(SdcError, match=words):
        BitFlipInjector(FlipSpec.from_dict(spec), rank=0).validate([m], world=2)
    BitFlipInjector(FlipSpec.from_dict({"target": "param", "tensor": "w", "bit": 31, "element": -1}),
                    rank=0).validate([m], world=2)


@pytest.mark.parametrize("key,value,words", [
    ("check_every", -2, "'sdc.check_every' must be ≥ 0"), ("bound_safety", 0.5, "'sdc.bound_safety' must be ≥ 1"),
    ("max_transients", 0, "'sdc.max_transients' must be ≥ 1"), ("spike_window", 0, "'sdc.spike_window' must be ≥ 1"),
    ("spike_warmup", 80, "never be judged"), ("probe_dtypes", ("float99",), "not a floating-point torch dtype"),
])
def test_sdc_knobs_that_would_break_a_check_are_config_errors(key, value, words):
    from resilient.gpt.config import load_config
    from resilient.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        SdcConfig(**{key: value})
    toml = f"sdc.{key}={list(value) if isinstance(value, tuple) else value}".replace("'", '"')
    with pytest.raises(ConfigError, match=words):
        load_config(None, [toml])
