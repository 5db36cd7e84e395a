"""The SDC checks of a job: what to watch on the script's model, bit flips, replay.

:class:`SdcGuard` attaches :class:`~resilient.sdc.monitor.SdcMonitor` to the
modules and optimizers a :class:`~resilient.job.Job` was given, choosing the
checks their kind allows:

- FSDP2 (``fully_shard``) with several data-parallel ranks: the linear check of
  every reduce-scatter (what went in sums to what came out, within a rounding
  bound from the dtype and sizes);
- DDP: gradients after the all-reduce, and parameters after the step, must be
  bitwise equal on every rank (replica checks);
- anything else (one process, a model the checks cannot see into): non-finite
  and spike checks of the loss and the local gradients, said once as an event;
- always: the optimizer's state and the parameters hashed at rest between steps, and
  what the device computes: every ``nn.Linear`` GEMM against its checksum identity and
  each block's output range against its history (``abft_every``, ``activation_every``).

It also owns the bit-flip injectors (``[sdc] inject`` and the chaos harness's
requests) and fires them at the points of a step where a flip means something.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from resilient.events import EventLog
from resilient.sdc.api import Action, Decision, SdcConfig, SdcError
from resilient.sdc.crosscheck import CrossCheck
from resilient.sdc.inject import HOOKED, MODULE_TARGETS, BitFlipInjector, FlipSpec, StrikeRecord
from resilient.sdc.monitor import SdcMonitor


STRIKES_DIR = "sdc-strikes"   # under the run dir: which transient flips struck (StrikeRecord)


def fsdp_units(modules: Sequence[nn.Module]) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for module in modules for m in module.modules() if isinstance(m, FSDPModule)]


def is_fsdp(modules: Sequence[nn.Module]) -> bool:
    return bool(fsdp_units(modules))


def is_ddp(modules: Sequence[nn.Module]) -> bool:
    return any(isinstance(m, nn.parallel.DistributedDataParallel) for m in modules)


class ModelView:
    """Several modules (pipeline stages) seen as one for name look-ups: what the
    injectors and the chaos hooks need (``named_parameters``, ``named_modules``)."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list(modules)

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_modules(self):
        for m in self.modules:
            yield from m.named_modules()


class _Optimizers:
    """The optimizers as one ``.state`` mapping, for the injectors' ``optim_state`` flips."""

    def __init__(self, optimizers: Sequence[Any]):
        self.optimizers = [o for o in optimizers if o is not None]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}


class SdcGuard:
    """The checks and the injectors of one rank. ``monitor`` is None with ``enable = false``
    (injectors still fire: a drill of what goes unseen without the checks)."""

    def __init__(self, cfg: SdcConfig, modules: Sequence[nn.Module], optimizers: Sequence[Any], *,
                 events: EventLog, device: torch.device, rank: int, world: int, node: str = "",
                 local_rank: int = 0, watch_fsdp: bool | None = None, post_scale: float = 1.0,
                 run_dir: str | os.PathLike | None = None):
        self.cfg, self.events, self.rank = cfg, events, rank
        self.modules = list(modules)
        self.fsdp = fsdp_units(self.modules)
        self.view = ModelView(self.modules)
        self.optim = _Optimizers(optimizers)
        self.monitor: SdcMonitor | None = None
        self.coverage = "off"
        if cfg.enable:
            self.monitor = SdcMonitor(cfg, events=events, device=device)
            for opt in self.optim.optimizers:
                self.monitor.watch_optimizer(opt)   # Adam state at rest: hashed after a step, verified before the next
            self.coverage = self._watch(world, watch_fsdp, post_scale)
            self.monitor.watch_compute(self.modules)   # Linear GEMM checksums, block output ranges
        # sampled cross-device replay: each rank's forward recomputed by its neighbour (crosscheck.py)
        self.cross = CrossCheck(cfg.cross_check_budget, cfg.cross_check_max_period, rank, world) \
            if cfg.enable and world > 1 else None
        specs = [FlipSpec.from_dict(dict(d)) for d in cfg.inject]
        # a transient flip strikes once per run, across worker restarts: noted in the run dir
        self.flips = [BitFlipInjector(spec, rank, log=lambda rec: events.emit("fault_injected", **rec),
                                      node=node, local_rank=local_rank,
                                      record=StrikeRecord(Path(run_dir) / STRIKES_DIR, i, spec) if run_dir else None)
                      for i, spec in enumerate(specs)]
        for flip in self.flips:   # forward/backward flips fire from hooks on the module or parameter they name
            flip.validate(self.modules, world)
            if flip.spec.target in HOOKED and flip.here():
                names = (lambda m: dict(m.named_modules())) if flip.spec.target in MODULE_TARGETS else (
                    lambda m: dict(m.named_parameters()))
                part = next((m for m in self.modules if flip.spec.tensor in names(m)), None)
                if part is None:
                    raise SdcError(f"sdc.inject: nothing named {flip.spec.tensor!r} on rank {rank} for a "
                                   f"{flip.spec.target} flip")
                flip.attach(part)

    def _watch(self, world: int, watch_fsdp: bool | None, post_scale: float) -> str:
        """Register the checks the modules' kind allows; returns what covers the gradients."""
        fsdp = is_fsdp(self.modules) and world > 1 if watch_fsdp is None else watch_fsdp
        if fsdp:
            # A pipeline schedule reduces once per stage after the last micro-batch, then divides
            # the reduced gradients by the micro-batch count: the check must expect that.
            self.monitor.watch_fsdp(self.modules, post_scale=post_scale)
            return "fsdp-reduce-scatter"
        if is_ddp(self.modules) and world > 1:
            params = [(n, p) for n, p in self.view.named_parameters() if p.requires_grad]
            group = dist.group.WORLD
            self.monitor.watch_replicas("ddp-grads", lambda: [(n, p.grad) for n, p in params], group)
            self.monitor.watch_replicas("ddp-params", lambda: params, group, what="param")
            return "ddp-replicas"
        if self.rank == 0:
            self.events.emit("sdc_coverage", coverage="local", reason=(
                "the model is neither FSDP2-sharded over several ranks nor DDP: its gradients get the "
                "non-finite and spike checks only (no reduction or replica check); parameters and "
                "optimizer state are still hashed at rest"))
        return "local"

    # -------------------------------------------------------------- flips
    def inject(self, step: int, *targets: str) -> None:
        for flip in self.flips:
            if flip.spec.target in targets:
                flip.maybe_inject(step, self.view, self.optim)

    def begin_step(self, step: int) -> None:
        """Before step ``step + 1`` (``step`` completed): flips "at rest" strike between
        steps, after ``step`` was saved and before the next one reads the parameters."""
        self.inject(step, "param", "optim_state")
        for flip in self.flips:
            flip.current_step = step + 1  # activation flips fire inside forward
        if self.cross is not None and self.cross.due(step + 1):
            self.cross.note_rng()   # the RNG state the sampled step's forward starts from

    def sampled_checks(self) -> dict[str, str]:
        """The sampled checks in force and their periods (the run_start event's fields)."""
        out = {}
        if self.cross is not None and self.cross.active:
            out["sdc_cross_check"] = self.cross.describe()
        gemms = self.monitor.describe_sampling() if self.monitor is not None else None
        if gemms:
            out["sdc_gemm_check"] = gemms
        return out

    def cross_check(self, step: int, loss, batch, recompute, step_seconds: float) -> None:
        """The sampled cross-device replay of ``step`` (collective on sampled steps; a no-op on
        the others, decided from the step number on every rank alike). Its suspicions join
        the monitor's next agreement (``after_backward``)."""
        if self.cross is None or self.monitor is None or not self.cross.due(step):
            return
        t0 = time.perf_counter()
        sus = self.cross.run(step, loss, batch, recompute, step_seconds)
        self.settle()   # a forward without backward leaves FSDP2's root parameters gathered
        if self.rank == 0:
            self.events.emit("sdc_cross_check", step=step, seconds=round(time.perf_counter() - t0, 4),
                             period=self.cross.period, mismatches=len(sus))
        if sus:
            self.monitor.report(sus)
        else:
            self.monitor.cross_clean_step = step   # a rollback for a fault this check finds goes no later

    # ------------------------------------------------------------- checks
    def after_backward(self, step: int, loss, replay: Callable[[], Any] | None):
        """Gradient checks of ``step`` (after backward, before clipping and the optimizer).
        A suspect step is recomputed with ``replay()`` (zeroed gradients first); the monitor
        compares the answers and decides. Returns (loss, decision)."""
        self.inject(step, "grad")
        if self.monitor is None:
            return loss, Decision()
        decision = self.monitor.after_backward(step, self.modules, loss)
        while decision.action is Action.REPLAY:
            if replay is None:
                raise SdcError(f"step {step} is suspect and must be replayed, but no replay function was "
                               "given: pass replay= (the step's forward and backward) to Job.verify")
            for opt in self.optim.optimizers:
                opt.zero_grad(set_to_none=True)
            loss = replay()
            self.inject(step, "grad")  # a persistent fault strikes the replay too
            decision = self.monitor.after_replay(step, self.modules, loss)
        return loss, decision

    def settle(self) -> None:
        """Register FSDP2's sharded parameters again. A forward without backward (an
        evaluation in the loop's body) leaves the root's parameters gathered (FSDP2 keeps
        them for the backward that never comes): the at-rest hashes, the snapshot and the
        digest must see the sharded ones, which the next step's forward starts from anyway.
        Nothing to do (no communication) when they are sharded already."""
        for unit in self.fsdp:
            unit.reshard()

    def after_optimizer_step(self, step: int) -> Decision:
        if self.monitor is None:
            return Decision()
        return self.monitor.after_optimizer_step(step, self.modules)

    @property
    def last_verified(self) -> int | None:
        return self.monitor.last_verified if self.monitor is not None else None

    def note_restored(self, step: int) -> None:
        if self.monitor is not None:   # the at-rest hashes start here (restored or initialized)
            self.monitor.note_restored(step, self.modules)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
