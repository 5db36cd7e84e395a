"""Tensor parallelism (DTensor ``parallelize_module``, tp=2 gloo ranks): the
norm weight is replicated across tp, so its gradient must be bitwise equal on
both ranks. Clean steps agree; a flip on one rank is caught and, replayed,
pinned on that rank."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from resilient.sdc.harness import GlooPool

pytestmark = pytest.mark.slow


def tp_run(rank, world, seed, steps, flip, nan_at=None):
    """``nan_at``: (rank, step) whose ``up`` gradient gets one NaN, once (a transient fault
    in a layout with no reduction check: dp = 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from resilient.sdc.api import Action
    from resilient.sdc.inject import BitFlipInjector, FlipSpec
    from resilient.sdc.monitor import SdcMonitor

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    net = torch.nn.ModuleDict({"norm": torch.nn.RMSNorm(16), "up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)})
    parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    tp_group = mesh.get_group("tp")
    mon = SdcMonitor()
    mon.watch_replicas("norm.grad", lambda: [("norm.weight", net["norm"].weight.grad)], tp_group, what="grad")
    inj = BitFlipInjector(FlipSpec.from_dict(flip), rank) if flip else None
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    log, poisoned = [], []

    def fwd_bwd(step):
        g = torch.Generator().manual_seed(seed * 100 + step)      # tp ranks see the same batch
        x = torch.randn(8, 16, generator=g)
        h = net["norm"](x)
        loss = net["down"](torch.relu(net["up"](h))).square().mean()
        loss.backward()
        if inj:
            inj.maybe_inject(step, net)
        if nan_at == (rank, step) and not poisoned:
            poisoned.append(step)
            net["up"].weight.grad.to_local()[0, 0] = float("nan")
        return loss.detach()

    for step in range(steps):
        loss = fwd_bwd(step)
        d = mon.after_backward(step, net, loss)
        if d.suspicions:
            log.append((step, "after_backward", sorted({(s.rank, s.kind, s.harmless) for s in d.suspicions}), {}))
        while d.action is Action.REPLAY:
            opt.zero_grad()
            loss = fwd_bwd(step)
            d = mon.after_replay(step, net, loss)
            log.append((step, "after_replay", [], {r: v.value for r, v in d.verdicts.items()}))
        opt.step()
        opt.zero_grad()
        mon.after_optimizer_step(step, net)
    return log


@pytest.fixture(scope="module")
def pool():
    with GlooPool(2, timeout=timedelta(seconds=45)) as p:
        yield p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tp_replicated_norm_grads_agree_bitwise_when_clean(pool, seed):
    assert pool.run(tp_run, seed, 6, None) == [[], []]


@pytest.mark.parametrize("bit", [31, 30, 22])
def test_tp_replicated_norm_grad_flip_is_caught_and_attributed(pool, bit):
    flip = {"target": "grad", "tensor": "norm.weight", "bit": bit, "rank": 1, "step": 2, "element": 5}
    for log in pool.run(tp_run, 0, 4, flip):
        assert log[0][:3] == (2, "after_backward", [(0, "replica_mismatch", False), (1, "replica_mismatch", False)])
        assert log[1][3] == {0: "false_alarm", 1: "transient"}, log


def test_tp_nan_gradient_is_caught_without_a_reduction_check(pool):
    """dp = 1: no linear check sees the gradients. One NaN on rank 1 must still be
    caught before the optimizer spreads it to every parameter (and the snapshot)."""
    for log in pool.run(tp_run, 0, 4, None, (1, 2)):
        assert log[0][:3] == (2, "after_backward", [(1, "nonfinite", False)])
        assert log[1][3] == {1: "transient"}, log


def tp_adam_run(rank, world, steps, flip, watch_state):
    """The tp-replicated norm under AdamW: its Adam state is replicated too. A flip
    in one rank's copy is caught at rest (``watch_optimizer``) before the step
    that reads it; without that, by the replicated parameters after the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from resilient.sdc.inject import BitFlipInjector, FlipSpec
    from resilient.sdc.monitor import SdcMonitor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    net = torch.nn.ModuleDict({"norm": torch.nn.RMSNorm(16), "up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)})
    parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mon = SdcMonitor()
    mon.watch_replicas("norm", lambda: [("norm.weight", net["norm"].weight)], mesh.get_group("tp"), what="param")
    if watch_state:
        mon.watch_optimizer(opt)
    inj = BitFlipInjector(FlipSpec.from_dict(flip), rank)
    log = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        net["down"](torch.relu(net["up"](net["norm"](torch.randn(8, 16, generator=g))))).square().mean().backward()
        d = mon.after_backward(step, net, None)
        if d.suspicions:
            log.append((step, "after_backward", d.action.value, sorted({(s.rank, s.kind) for s in d.suspicions})))
            break
        opt.step()
        opt.zero_grad()
        d = mon.after_optimizer_step(step, net)
        if d.suspicions:
            log.append((step, "after_optimizer_step", d.action.value, sorted({(s.rank, s.kind) for s in d.suspicions})))
            break
        inj.maybe_inject(step, net, opt)
    return log


@pytest.mark.parametrize("watch_state", [True, False])
def test_tp_replicated_adam_state_flip_is_caught(pool, watch_state):
    flip = {"target": "optim_state", "tensor": "norm.weight", "bit": 28, "rank": 1, "step": 1, "element": 3,
            "state_key": "exp_avg"}
    for log in pool.run(tp_adam_run, 4, flip, watch_state):
        if watch_state:   # at rest: before the optimizer step that would read it, on its own rank
            assert log == [(2, "after_backward", "rollback", [(1, "optim_state_at_rest")])], log
        else:             # replicated: the norm weights differ after that step (two replicas: both suspect)
            assert log == [(2, "after_optimizer_step", "rollback",
                            [(0, "replica_mismatch"), (1, "replica_mismatch")])], log
