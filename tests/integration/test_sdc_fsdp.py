"""SDC detection on a real 2-process gloo job: FSDP2 over dp=2 plus a DDP-style
replicated parameter. Bit flips in gradients and parameters are caught within
one step and pinned on the rank that holds them; replay tells transient from
persistent; a lowest-bit flip is HARMLESS; clean runs raise nothing.

One pool of two gloo workers serves the whole module (see resilient.sdc.harness)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with GlooPool(2, timeout=timedelta(seconds=45)) as p:
        yield p


@pytest.fixture(scope="module")
def clean4(pool):
    """The fault-free 4-step run every healed run must match bitwise."""
    return pool.run(train, 0, (16, 32, 8), 4)


# ---------------------------------------------------------------- worker side
class Net(torch.nn.Module):
    """2-layer MLP sharded by FSDP2, and ``scale``: replicated, synced DDP-style."""

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out)
        self.scale = torch.nn.Parameter(torch.ones(d_out))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _median_element(t) -> int:
    x = t._local_tensor if hasattr(t, "_local_tensor") else t
    a = x.detach().reshape(-1).abs()
    return int(a.argsort()[a.numel() // 2])


def _bad_matmul(a, b):
    from resilient.sdc.inject import flip_bit
    c = torch.matmul(a, b)
    flip_bit(c, 11, 30)
    return c


def train(rank, world, seed=0, shape=(16, 32, 8), steps=5, flips=(), mp=None, monitor=True, cfg_kw=None, events=None,
          bad_probe_rank=None, packed=False):
    """Run ``steps`` steps; apply ``flips`` (FlipSpec dicts; element=None → the
    local median-magnitude element); return decisions and final local params.
    ``packed``: the optimizer state is materialized up front in one flat buffer,
    as the trainer does (:func:`resilient.gpt.optim.init_state`); else Adam creates it
    lazily, one tensor each."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from resilient.sdc.api import Action, SdcConfig
    from resilient.sdc.inject import BitFlipInjector, FlipSpec
    from resilient.sdc.monitor import SdcMonitor
    from resilient.sdc.reduction import checked_all_reduce

    torch.manual_seed(seed)
    d_in, hidden, d_out = shape
    net = Net(d_in, hidden, d_out)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, mp[0]), reduce_dtype=getattr(torch, mp[1])) if mp else MixedPrecisionPolicy()
    fully_shard(net.fc1, mesh=mesh, mp_policy=policy)
    fully_shard(net.fc2, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    if packed:
        from resilient.optim_state import init_state
        init_state(opt, net)
    from resilient.events import EventLog
    from resilient.sdc.probes import Prober
    prober = Prober("cpu", dtypes=("float32",), matmul_n=32, reduce_n=1024, matmul=_bad_matmul) if rank == bad_probe_rank else None
    mon = SdcMonitor(SdcConfig(**(cfg_kw or {})), events=EventLog(events, rank=rank) if events else None, prober=prober)
    if monitor:
        mon.watch_fsdp(net)
        mon.watch_optimizer(opt)
        mon.watch_replicas("scale.grad", lambda: [("scale", net.scale.grad)], dist.group.WORLD, what="grad")
        mon.watch_replicas("scale", lambda: [("scale", net.scale)], dist.group.WORLD, what="param")
    specs = [FlipSpec.from_dict({**f, "element": f.get("element") if f.get("element") is not None else 0}) for f in flips]
    injectors = [(BitFlipInjector(s, rank), f.get("element") is None) for s, f in zip(specs, flips)]
    for inj, _ in injectors:
        inj.attach(net)          # forward hooks for activation flips
    log = []

    def fwd_bwd(step):
        for inj, _ in injectors:
            inj.current_step = step
        g = torch.Generator().manual_seed(seed * 7919 + step * 31 + rank)
        x, y = torch.randn(8, d_in, generator=g), torch.randn(8, d_out, generator=g)
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        mon.report(checked_all_reduce([net.scale.grad], step=step, name="scale.grad"))
        return loss.detach()

    def inject(step, target):
        for inj, median in injectors:
            if inj.spec.target != target:
                continue
            if median and inj.rank == inj.spec.rank and target != "activation":
                p = dict(net.named_parameters())[inj.spec.tensor]
                where = {"grad": lambda: p.grad, "param": lambda: p, "optim_state": lambda: opt.state[p][inj.spec.state_key]}
                inj.spec.element = _median_element(where[target]())
            inj.maybe_inject(step, net, opt)

    def record(step, phase, d):
        if d.suspicions or d.action is not Action.CONTINUE:
            log.append({"step": step, "phase": phase, "action": d.action.value,
                        "suspects": sorted({(s.rank, s.kind, s.harmless) for s in d.suspicions}),
                        "verdicts": {r: v.value for r, v in d.verdicts.items()}, "quarantine": d.quarantine,
                        "rollback_to": d.rollback_to})

    stopped = None
    for step in range(steps):
        loss = fwd_bwd(step)
        inject(step, "grad")
        d = mon.after_backward(step, net, loss)
        record(step, "after_backward", d)
        while d.action is Action.REPLAY:
            opt.zero_grad()
            loss = fwd_bwd(step)
            inject(step, "grad")
            d = mon.after_replay(step, net, loss)
            record(step, "after_replay", d)
        if d.action is not Action.CONTINUE:
            stopped = step
            break
        opt.step()
        opt.zero_grad()
        d = mon.after_optimizer_step(step, net)
        record(step, "after_optimizer_step", d)
        if d.action is not Action.CONTINUE:
            stopped = step
            break
        inject(step, "param")
        inject(step, "optim_state")
        if step == 1 and bad_probe_rank is not None:
            mon.prober.run_once("periodic")   # what the background thread does every probe_every seconds
    params = {n: (p._local_tensor if hasattr(p, "_local_tensor") else p).detach().clone() for n, p in net.named_parameters()}
    storages = {(v._local_tensor if hasattr(v, "_local_tensor") else v).untyped_storage().data_ptr()
                for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()}
    return {"log": log, "stopped": stopped, "params": params, "state_storages": len(storages)}


# ---------------------------------------------------------------- tests
def _flat(logs):
    return [e for e in logs]


def test_clean_run_raises_nothing_and_matches_unchecked(pool):
    checked = pool.run(train, 0, (16, 32, 8), 6)
    plain = pool.run(train, 0, (16, 32, 8), 6, (), None, False)
    packed = pool.run(train, 0, (16, 32, 8), 6, (), None, True, None, None, None, True)
    for r in range(2):
        assert checked[r]["log"] == [] and checked[r]["stopped"] is None
        assert packed[r]["log"] == [] and packed[r]["stopped"] is None
        assert packed[r]["state_storages"] == 1 and checked[r]["state_storages"] > 1   # packed, and stays so
        for n, t in checked[r]["params"].items():   # the checks change no bit of training, nor does packing
            assert torch.equal(t, plain[r]["params"][n]), n
            assert torch.equal(packed[r]["params"][n], plain[r]["params"][n]), n


@pytest.mark.parametrize("tensor,bit", [("fc1.weight", 31), ("fc1.weight", 30), ("fc1.weight", 23), ("fc1.weight", 22),
                                        ("fc1.weight", 16), ("fc2.bias", 31), ("fc2.bias", 22)])
# sign, exponent (top, lowest), mantissa (top, the lowest of the "high" class):
# the reduced gradient is hashed as the collective wrote it, so a flip after it is seen exactly
def test_grad_flip_detected_attributed_and_healed_by_replay(pool, clean4, bit, tensor):
    flip = {"target": "grad", "tensor": tensor, "bit": bit, "rank": 1, "step": 2, "element": None}
    res = pool.run(train, 0, (16, 32, 8), 4, (flip,))
    clean = clean4
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["step"] == 2 and log[0]["action"] == "replay", log
        assert {s[0] for s in log[0]["suspects"]} == {1}, log            # only the flipped rank
        assert log[1]["verdicts"] == {1: "transient"} and log[1]["action"] == "continue", log
        assert res[r]["stopped"] is None
        for n, t in res[r]["params"].items():   # replay healed it: bitwise the fault-free run
            assert torch.equal(t, clean[r]["params"][n]), (n, bit)


def test_persistent_grad_fault_is_quarantined(pool, tmp_path):
    flip = {"target": "grad", "tensor": "fc1.weight", "bit": 30, "rank": 0, "step": 1, "element": None,
            "persistent": True}
    res = pool.run(train, 0, (16, 32, 8), 4, (flip,), None, True, None, str(tmp_path / "events.jsonl"))
    from resilient.events import read_events
    ev = list(read_events(tmp_path / "events.jsonl"))
    kinds = [e["event"] for e in ev]
    assert kinds[:2] == ["sdc_suspect", "sdc_replay"] and "sdc_probe" in kinds, kinds
    assert kinds[-3:] == ["sdc_verdict", "quarantine", "rollback"], kinds
    assert ev[-3]["verdict"] == "persistent" and ev[-2]["suspect_rank"] == 0 and ev[-1]["to_step"] == 0
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["action"] == "replay" and {s[0] for s in log[0]["suspects"]} == {0}
        assert log[1]["verdicts"] == {0: "persistent"} and log[1]["action"] == "quarantine"
        assert log[1]["quarantine"] == [0] and res[r]["stopped"] == 1


@pytest.mark.parametrize("bit", [31, 30, 22])
def test_param_flip_at_rest_detected_next_step(pool, bit):
    flip = {"target": "param", "tensor": "fc2.weight", "bit": bit, "rank": 0, "step": 1, "element": None}
    res = pool.run(train, 0, (16, 32, 8), 3, (flip,))
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["step"] == 2 and log[0]["action"] == "rollback", log   # within one step
        assert (0, "param_at_rest", False) in log[0]["suspects"]
        assert log[0]["verdicts"] == {0: "transient"} and log[0]["rollback_to"] == 0


@pytest.mark.parametrize("key,bit,packed", [("exp_avg", 31, False), ("exp_avg_sq", 27, False), ("exp_avg", 12, False),
                                            ("step", 23, False), ("exp_avg", 31, True), ("exp_avg_sq", 12, True),
                                            ("step", 23, True)])
def test_optimizer_state_flip_at_rest_is_caught_before_the_step_that_reads_it(pool, key, bit, packed):
    flip = {"target": "optim_state", "tensor": "fc1.weight", "bit": bit, "rank": 1, "step": 1, "element": None,
            "state_key": key}
    res = pool.run(train, 0, (16, 32, 8), 3, (flip,), None, True, None, None, None, packed)
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["step"] == 2 and log[0]["action"] == "rollback", log   # after backward, before the optimizer
        assert (1, "optim_state_at_rest", False) in log[0]["suspects"]
        assert log[0]["verdicts"] == {1: "transient"} and log[0]["rollback_to"] == 0


@pytest.mark.parametrize("bit", [31, 22])
def test_replicated_grad_flip_replay_singles_out_rank(pool, bit):
    flip = {"target": "grad", "tensor": "scale", "bit": bit, "rank": 1, "step": 1, "element": None}
    res = pool.run(train, 0, (16, 32, 8), 3, (flip,))
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["action"] == "replay"
        assert (0, "replica_mismatch", False) in log[0]["suspects"]     # two replicas: both suspect
        assert (1, "replica_mismatch", False) in log[0]["suspects"]
        assert log[1]["verdicts"] == {0: "false_alarm", 1: "transient"}, log
        assert res[r]["stopped"] is None


@pytest.mark.parametrize("target,tensor", [("param", "fc1.weight"), ("grad", "scale"), ("param", "scale")])
def test_lowest_mantissa_flip_is_harmless(pool, target, tensor):
    flip = {"target": target, "tensor": tensor, "bit": 0, "rank": 1, "step": 1, "element": None}
    res = pool.run(train, 0, (16, 32, 8), 4, (flip,))
    for r in range(2):
        log = res[r]["log"]
        assert log and all(e["action"] == "continue" for e in log), log
        assert set(log[0]["verdicts"].values()) == {"harmless"}
        assert res[r]["stopped"] is None


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2 ** 16), d_in=st.integers(3, 40), hidden=st.integers(1, 70), d_out=st.integers(1, 9),
       mp=st.sampled_from([None, ("bfloat16", "float32"), ("bfloat16", "bfloat16")]))
def test_no_false_positives_over_seeds_and_shapes(pool, seed, d_in, hidden, d_out, mp):
    res = pool.run(train, seed, (d_in, hidden, d_out), 5, (), mp)
    for r in range(2):
        assert res[r]["log"] == [] and res[r]["stopped"] is None, res[r]["log"]


def test_activation_flip_to_infinity_is_nonfinite_and_transient(pool, clean4):
    flip = {"target": "activation", "tensor": "fc1", "bit": 30, "rank": 1, "step": 2, "element": 3}
    res = pool.run(train, 0, (16, 32, 8), 4, (flip,))
    clean = clean4
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["step"] == 2 and log[0]["action"] == "replay", log
        assert {s[0] for s in log[0]["suspects"]} == {1} and ("nonfinite" in {s[1] for s in log[0]["suspects"]})
        assert log[1]["verdicts"] == {1: "transient"}
        for n, t in res[r]["params"].items():
            assert torch.equal(t, clean[r]["params"][n]), n


def test_failed_background_probe_quarantines_its_rank(pool):
    res = pool.run(train, 0, (16, 32, 8), 4, (), None, True, None, None, 1)
    for r in range(2):
        log = res[r]["log"]
        assert log[0]["step"] == 2 and log[0]["action"] == "quarantine" and log[0]["quarantine"] == [1], log
        assert (1, "probe_failure", False) in log[0]["suspects"] and log[0]["rollback_to"] == 1
