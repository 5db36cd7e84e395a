"""SdcMonitor: the SDC checks at the training loop's hook points.

The loop calls three hooks; each returns a :class:`~resilient.sdc.api.Decision`
that is identical on every rank (the hooks are collective over the world group,
so call them on every rank, every step)::

    mon = SdcMonitor(cfg.sdc, events=log)
    mon.watch_fsdp(model)                                  # after fully_shard
    mon.watch_optimizer(optimizer)                         # its state is verified at rest
    mon.watch_replicas("norms", lambda: [(n, p.grad) for n, p in norms], tp_group)
    for step in steps:
        loss = forward_backward(batch)
        d = mon.after_backward(step, model, loss)
        while d.action is Action.REPLAY:                   # recompute the same step
            optimizer.zero_grad(); loss = forward_backward(batch)
            d = mon.after_replay(step, model, loss)
        if d.action in (Action.ROLLBACK, Action.QUARANTINE):
            restore(d.rollback_to); quarantine(d.quarantine); continue
        optimizer.step(); optimizer.zero_grad()
        d = mon.after_optimizer_step(step, model)          # then capture the snapshot
        if d.action is not Action.CONTINUE: restore(d.rollback_to) ...

What each hook checks (details in the modules):

* ``after_backward``: the linear check of every FSDP2 reduce-scatter and the
  reduced gradients' bit-sums since it (:mod:`.reduction`), bitwise equality of
  registered replicated gradients (:func:`.checksums.compare_replicas`),
  parameters and the watched optimizers' state at rest (the hashes taken by
  ``after_optimizer_step`` must still hold: nothing may change them between two
  optimizer steps; :mod:`.atrest`), non-finite loss and pre-reduction gradients,
  and robust spikes of the loss and of each rank's pre-reduction gradient L1.
  A gradient-side suspicion asks for a REPLAY: the pre-step state is intact
  (the optimizer has not run), so recomputing the step is the recovery.
* ``after_replay``: the exact checks again, plus each rank's fingerprint of
  its gradients against the original; the :class:`.replay.ReplayStateMachine`
  turns them into verdicts. On-demand probes settle reproducible suspicions.
* ``after_optimizer_step``: records the at-rest hashes (parameters every
  ``param_check_every`` steps, optimizer state every ``state_check_every``)
  and compares registered replicated parameters.

Events (``resilient.events``): ``sdc_suspect``, ``sdc_replay``,
``sdc_verdict``, ``sdc_probe``, ``quarantine``, ``rollback``; written by world
rank 0 (every rank holds the same agreed facts), probes by the rank that ran them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from resilient.sdc.abft import GemmCheck, attach_abft
from resilient.sdc.activations import ActivationCheck, attach_activation_checks, reached_the_step
from resilient.sdc.api import (KIND_ACTIVATION_SPIKE, KIND_AT_REST, KIND_CROSS, KIND_GEMM, KIND_LOSS_SPIKE, KIND_NONFINITE, KIND_PROBE, KIND_REPLICA,
                               KIND_STATE_AT_REST, Action, Decision, SdcConfig, SdcDetected, SdcError, Spent, Suspicion,
                               Verdict)
from resilient.sdc.parts import Parts, _named_params, _parts, _timed, device_id  # noqa: F401 - device_id: public here too
from resilient.sdc.atrest import Resting, at_rest_delta  # noqa: F401 - at_rest_delta: its public home was here
from resilient.sdc.checksums import LocalGradCheck, RobustSpike, compare_replicas
from resilient.sdc.probes import Prober
from resilient.sdc.reduction import ReductionCheck, attach_fsdp
from resilient.sdc.replay import EXACT_KINDS, Match, ReplayStateMachine, compare, fingerprint
from resilient.sdc.sampling import SampledSteps

# state the optimizer step wrote and nothing else may touch: a change cannot be replayed away
AT_REST_KINDS = frozenset({KIND_AT_REST, KIND_STATE_AT_REST})
# A GEMM-checked step's extra cost as a share of a plain one until a sample measures it: 1.3x on
# CPU at the demo's size (python bench/sdc_compute.py --only gemms), so 1 step in 30 at a 1% budget
GEMM_SHARE = 0.3
# The first sampled GEMM step: step 2 is the first whose plain time is measured (end to end),
# step 3 then measures the checks' share of it and finds the device clean early
GEMM_FIRST_SAMPLE = 3


@dataclass
class _ReplicaSet:
    name: str
    tensors: Callable[[], Iterable[tuple[str, torch.Tensor | None]]]
    group: object
    what: str  # "grad" or "param"


class SdcMonitor:
    """Runs the SDC checks at the hook points and agrees on one decision.

    ``group`` is the world group (default: the default group) over which
    decisions are agreed; ``device`` names this rank's device for attribution;
    ``prober`` runs on-demand probes on this rank's device (built from ``cfg``
    when omitted). With ``cfg.enable = False`` every hook returns CONTINUE at
    once and no collective is issued.
    """

    def __init__(self, cfg: SdcConfig | None = None, *, events=None, group=None,
                 device: torch.device | str | None = None, prober: Prober | None = None):
        self.cfg = cfg or SdcConfig()
        self.events = events
        self.group = group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        # global rank of each position in ``group`` (what suspicions name)
        self.granks = dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() else [0]
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.prober = prober or Prober.from_config(self.cfg, self.device, events=events)
        self.reductions: list[ReductionCheck] = []
        self.local_grads = LocalGradCheck(self.cfg.grad_spike_k, self.cfg.spike_window, self.cfg.spike_warmup)
        self.replicas: list[_ReplicaSet] = []
        self.gemms: GemmCheck | None = None              # checksummed Linear GEMMs (watch_compute)
        self.activations: ActivationCheck | None = None  # block output ranges (watch_compute)
        self.sm = ReplayStateMachine(max_transients=self.cfg.max_transients)
        self.loss_spikes: dict[int, RobustSpike] = {}
        self.devices: dict[int, str] = {}
        self.resting = Resting()   # parameters and optimizer state: hashed after a due step, verified at the next
        self._last_verified = -1   # newest step whose parameters a check verified clean
        # newest step whose forward the cross-device replay found clean on every rank: a
        # persistent fault it attributes struck after it, so a rollback goes no later
        self.cross_clean_step = 0
        # the GEMM checks at the budget's period (``abft_every = 0``): which steps, and the newest
        # step they found clean on every rank (a rollback for a fault they find goes no later)
        self.gemm_steps = SampledSteps(self.cfg.abft_budget, self.cfg.abft_max_period, GEMM_SHARE,
                                       first=GEMM_FIRST_SAMPLE) if self.cfg.abft_every == 0 else None
        self.gemm_clean_step = 0
        self._gemm_spent_at_arm = 0.0   # the GEMM hooks' wall seconds when this step's checks were armed
        self._t_step_end: float | None = None   # when the last step ended (after_optimizer_step)
        self._plain_step_s: float | None = None   # the newest step without GEMM checks, end to end
        self._external: list[Suspicion] = []
        # the mean loss over the ranks that have one, from this step's exchange: the loop's own
        # all-reduce of the loss for its log would move the same numbers again (see :meth:`_note_losses`)
        self.loss_mean: float | None = None
        self._spent = Spent()   # in the hooks (the reduce-scatter wrappers keep their own)
        self._probe_seen = 0
        self._named: tuple[list, list] | None = None   # (each part's first parameter, named parameters)
        if self.cfg.enable and self.cfg.probe_every > 0:
            self.prober.start(timedelta(seconds=self.cfg.probe_every))

    def close(self) -> None:
        """Stop the background prober (if ``probe_every`` started one); remove the compute hooks."""
        self.prober.stop()
        for chk in (self.gemms, self.activations):
            if chk is not None:
                chk.close()

    def _probe_suspicions(self, step: int) -> list[Suspicion]:
        """Failures of background probes on this device since the last hook."""
        results = self.prober.results[self._probe_seen:]
        self._probe_seen += len(results)
        return [Suspicion(step=step, rank=self.rank, kind=KIND_PROBE, tensor=f"{r.probe}:{r.dtype}",
                          evidence={"max_excess": r.max_excess, "max_err": r.max_err})
                for r in results if not r.ok]

    # ---- registration -------------------------------------------------
    def watch_fsdp(self, model_parts: Parts, group=None, post_scale: float = 1.0) -> None:
        """Linear checks on every FSDP2 unit of ``model_parts`` (call after fully_shard).

        ``post_scale``: what the loop multiplies the reduced gradients by before
        :meth:`after_backward` sees them; a pipeline schedule divides them by
        its micro-batch count (pass :func:`~.reduction.pipeline_post_scale`).
        With several parts (pipeline stages of one rank) each gets its own
        check over its own dp group.
        """
        if not self.cfg.enable:
            return
        for m in _parts(model_parts):
            chk = attach_fsdp(m, group, safety=self.cfg.bound_safety, spike_k=self.cfg.grad_spike_k,
                              spike_window=self.cfg.spike_window, spike_warmup=self.cfg.spike_warmup,
                              post_scale=post_scale)
            if chk.units:
                self.reductions.append(chk)

    def watch_compute(self, model_parts: Parts) -> None:
        """Check what this rank's device computes in forward and backward: every ``nn.Linear``
        GEMM against its checksum identity (``abft_every``, :mod:`.abft`) and each block's
        output range against its history (``activation_every``, :mod:`.activations`). Call
        before any other forward hook that must see the checked values (bit-flip injectors
        are prepended, so they strike first). Their suspicions join ``after_backward``."""
        if not self.cfg.enable:
            return
        named: list[tuple[str, nn.Module]] = []
        counts: dict[int, int] = {}
        for i, m in enumerate(_parts(model_parts)):
            prefix = f"{i}:" if not isinstance(model_parts, nn.Module) else ""
            named += [(prefix + n, mod) for n, mod in m.named_modules()]
            for _, p in m.named_parameters(remove_duplicate=False):
                counts[id(p)] = counts.get(id(p), 0) + 1
        if self.cfg.abft_every > 0 or (self.gemm_steps is not None and self.gemm_steps.active):
            self.gemms = attach_abft(named, self.cfg.bound_safety, {k for k, c in counts.items() if c > 1})
        if self.cfg.activation_every > 0:
            self.activations = attach_activation_checks(named, self.cfg.activation_spike_k, self.cfg.spike_window,
                                                        self.cfg.spike_warmup)

    def _compute_checks(self, step: int, judge: bool) -> list[Suspicion]:
        """This rank's GEMM and activation suspicions of the forward/backward just run."""
        out = self.gemms.collect(step, self.rank) if self.gemms is not None else []
        if self.activations is not None:
            out += self.activations.collect(step, self.rank, judge)
        return out

    def watch_replicas(self, name: str, tensors: Callable[[], Iterable[tuple[str, torch.Tensor | None]]],
                       group, what: str = "grad") -> None:
        """Tensors that must be bitwise equal across ``group``.

        ``tensors()`` returns (name, tensor) pairs in the same order on every
        rank of ``group``: reduced gradients (``what="grad"``, checked after
        backward: tp-replicated norm weights' grads) or parameters
        (``what="param"``, checked after the optimizer step every
        ``param_check_every`` steps: DDP replicas). Every rank of the world
        must register the same sets, each with its own group.
        """
        if what not in ("grad", "param"):
            raise ValueError(f"what={what!r}; use 'grad' or 'param'")
        self.replicas.append(_ReplicaSet(name, tensors, group, what))

    def watch_optimizer(self, optimizer) -> None:
        """Hash ``optimizer``'s state after each due step and verify it before the
        next one (``state_check_every``): Adam's moments and step counters are
        written by the optimizer step only, so any change in between is corruption,
        caught exactly, before the step that would read it. Works on a
        ``torch.optim.Optimizer`` or anything with a ``.state`` mapping from
        parameters to dicts of tensors (``resilient.gpt.optim.Optimizers``).
        Where the state is replicated (DDP, tp-replicated norms) a flip inside the
        optimizer's arithmetic shows up in the replicated parameters instead."""
        if not hasattr(optimizer, "state"):
            raise SdcError(f"{type(optimizer).__name__} has no .state mapping; pass the optimizer itself")
        # the torch optimizers inside ``Optimizers``: its ``.state`` is a new merged dict per call
        inner = getattr(optimizer, "optimizers", None)
        self.resting.optimizers += list(inner) if isinstance(inner, (list, tuple)) else [optimizer]

    def report(self, suspicions: Iterable[Suspicion]) -> None:
        """Add suspicions from checks run by the loop itself (e.g. the result of
        :func:`~resilient.sdc.reduction.checked_all_reduce` on DDP-style gradients);
        they join the next ``after_backward`` / ``after_replay`` agreement."""
        self._external.extend(suspicions)

    # ---- helpers -------------------------------------------------------
    def _emit(self, event: str, **fields) -> None:
        if self.events is not None and self.rank == 0:
            self.events.emit(event, **fields)

    def _params(self, model_parts: Parts) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of ``model_parts``, listed once per model (every step
        walks them twice; FSDP2's sharded parameters keep their identity; each
        part's first parameter witnesses that nothing re-bound them since)."""
        parts = _parts(model_parts)
        firsts = [next(iter(m.parameters()), None) for m in parts]
        if self._named is None or len(firsts) != len(self._named[0]) or any(
                a is not b for a, b in zip(firsts, self._named[0])):
            self._named = (firsts, _named_params(model_parts))
        return self._named[1]

    def _due(self, step: int, every: int) -> bool:
        return self.cfg.enable and every > 0 and step % every == 0

    def _gemms_due(self, step: int) -> bool:
        """``abft_every`` N: every N-th step; 0: the sampled steps of the budget."""
        if self.cfg.abft_every > 0 or self.gemm_steps is None:
            return self._due(step, self.cfg.abft_every)
        return self.cfg.enable and self.gemm_steps.due(step)

    @property
    def _gemms_sampling(self) -> bool:
        """Is the step being run one the budget sampled for the GEMM checks?"""
        return self.gemm_steps is not None and self.gemms is not None and self.gemms.armed

    def _gemm_share(self) -> float:
        """This rank's GEMM checks of the step just run as a share of a plain step (-1: no
        plain step measured yet, or not a sampled step)."""
        if not self._gemms_sampling or not self._plain_step_s:
            return -1.0
        return (self.gemms.spent.wall - self._gemm_spent_at_arm) / self._plain_step_s

    def _gemms_sampled(self, step: int, shares: torch.Tensor, sus: list[Suspicion]) -> None:
        """After a sampled step's exchange: the next period from the largest share any rank
        measured (the same on every rank); the step is clean unless a GEMM check failed."""
        if not self._gemms_sampling:
            return
        share = float(shares.max())
        self.gemm_steps.measured(step, share if share >= 0 else self.gemm_steps.share)
        failed = sum(s.kind == KIND_GEMM and not s.harmless for s in sus)
        if not failed:
            self.gemm_clean_step = step
        self._emit("sdc_gemm_check", step=step, share=round(share, 4) if share >= 0 else None,
                   period=self.gemm_steps.period, mismatches=failed)

    def describe_sampling(self) -> str | None:
        """The GEMM checks' schedule, for the start line (None: not sampled)."""
        g = self.gemm_steps
        if g is None or self.gemms is None or not g.active or not self.gemms.covered:
            return None   # not sampled, or no Linear to check
        return (f"checksummed GEMMs every {g.period} steps ({len(self.gemms.covered)} Linear layers, forward and "
                f"backward; budget {100 * g.budget:g}% of step time at a checked step ≈ {1 + g.share:.2f}x, "
                f"re-measured at each sample; a persistent fault beyond rounding is found within {g.max_period} steps at most)")

    def _arm_after(self, step: int) -> None:
        """The next step's backward records its reductions only if that step will be checked."""
        for chk in self.reductions:
            chk.arm(self._due(step + 1, self.cfg.check_every))
        if self.gemms is not None:
            self.gemms.arm(self._gemms_due(step + 1))
            self._gemm_spent_at_arm = self.gemms.spent.wall
        if self.activations is not None:
            self.activations.arm(self._due(step + 1, self.cfg.activation_every))

    def _devices(self) -> dict[int, str]:
        if not self.devices:
            mine = device_id(self.device)
            if dist.is_initialized() and self.world > 1:
                out: list = [None] * self.world
                dist.all_gather_object(out, (self.rank, mine), group=self.group)
                self.devices = dict(out)
            else:
                self.devices = {self.rank: mine}
        return self.devices

    def _agree(self, mine: list[Suspicion], extra=None) -> tuple[list[Suspicion], list]:
        """Union of every rank's suspicions (deduplicated), plus each rank's ``extra``.

        One all_gather_object; only on paths that already found something or on
        replay, so the clean path pays the tiny tensor all_gather in
        :meth:`_exchange_scalars` only.
        """
        if not dist.is_initialized() or self.world == 1:
            return mine, [extra]
        out: list = [None] * self.world
        dist.all_gather_object(out, (mine, extra), group=self.group)
        seen, merged = set(), []
        for sus, _ in out:
            for s in sus:
                key = (s.rank, s.kind, s.tensor)
                if key not in seen:
                    seen.add(key)
                    merged.append(s)
        merged.sort(key=lambda s: (s.rank, s.kind, s.tensor))
        return merged, [e for _, e in out]

    def _fusable(self) -> bool:
        """Can the reduction checks share the scalars' all_gather? Yes when their
        dp group is the monitor's whole group, in the same order (no tp, no pp)."""
        return bool(self.reductions) and all(chk.ranks == self.granks for chk in self.reductions)

    def _exchange_scalars(self, loss: float | None, n_local: int, tables=(), share: float = -1.0) -> torch.Tensor:
        """All-gather (loss, has_loss, n_suspicions, GEMM check share, *flattened tables) of every
        rank: ``[world, 4 + ...]``."""
        v = torch.tensor([loss if loss is not None else 0.0, 1.0 if loss is not None else 0.0, float(n_local),
                          share], dtype=torch.float64)
        if tables:
            v = torch.cat([v] + [t.reshape(-1) for t in tables])
        if not dist.is_initialized() or self.world == 1:
            return v.unsqueeze(0)
        dev = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        out = [torch.empty(v.numel(), dtype=torch.float64, device=dev) for _ in range(self.world)]
        dist.all_gather(out, v.to(dev), group=self.group)
        return torch.stack(out).cpu()

    def _note_losses(self, scalars: torch.Tensor) -> None:
        """Keep the mean of the gathered losses (``None`` when no rank has one).

        Every rank already sends its loss for the loss checks; the mean over the ranks
        that hold one is the data-parallel mean the loop logs (tensor-parallel ranks of
        a replica hold the same loss, pipeline stages but the last hold none), so the
        loop can skip a collective of its own each step."""
        have = scalars[:, 1] != 0
        self.loss_mean = float(scalars[have, 0].sum()) / int(have.sum()) if bool(have.any()) else None

    def _at_rest_check(self, step: int, model_parts: Parts) -> tuple[list[Suspicion], int | None]:
        return self.resting.verify(step, self._params(model_parts), self.rank, self._devices()[self.rank])

    def _grad_checks(self, step: int, judge: bool) -> list[Suspicion]:
        sus, self._external = self._external, []
        for chk in self.reductions:
            sus += chk.check(step, judge_spikes=judge)
        for rs in self.replicas:
            if rs.what == "grad":
                sus += compare_replicas(rs.tensors(), rs.group, step=step)
        return sus

    def _loss_checks(self, step: int, scalars: torch.Tensor, judge: bool) -> list[Suspicion]:
        out = []
        for i in range(scalars.shape[0]):
            if scalars[i, 1] == 0:
                continue
            r, x = self.granks[i], float(scalars[i, 0])
            if not math.isfinite(x):
                out.append(Suspicion(step=step, rank=r, kind=KIND_NONFINITE, tensor="loss", evidence={"loss": x}))
            elif judge and self.cfg.loss_spike_k > 0:
                det = self.loss_spikes.setdefault(r, RobustSpike(self.cfg.loss_spike_k, self.cfg.spike_window,
                                                                 self.cfg.spike_warmup))
                spike, z = det.check(x)
                if spike:
                    out.append(Suspicion(step=step, rank=r, kind=KIND_LOSS_SPIKE, tensor="loss",
                                         evidence={"loss": x, "robust_z": z}))
        return out

    def _finish(self, step: int, sus: list[Suspicion]) -> list[Suspicion]:
        devs = self._devices()
        for s in sus:
            s.device = s.device or devs.get(s.rank, "")
            self._emit("sdc_suspect", **s.as_event())
        return sus

    # ---- hooks -----------------------------------------------------------
    @_timed
    @torch.no_grad()
    def after_backward(self, step: int, model_parts: Parts, loss: torch.Tensor | float | None) -> Decision:
        """Gradient-side checks of ``step``; call after backward, before the optimizer."""
        self.loss_mean = None
        if not self.cfg.enable:
            return Decision()
        self._devices()   # collective on first use: every rank must reach it here
        grads_due = self._due(step, self.cfg.check_every)
        if not grads_due:
            for chk in self.reductions:
                chk.reset()
        fused = grads_due and self._fusable()
        if fused:   # the reductions' tables ride in the scalars' all_gather: one collective
            mine, self._external = self._external, []
            for rs in self.replicas:
                if rs.what == "grad":
                    mine += compare_replicas(rs.tensors(), rs.group, step=step)
        elif grads_due:
            mine = self._grad_checks(step, judge=True)
        else:
            mine, self._external = self._external, []
        if grads_due and not self.reductions:   # dp = 1: no reduction check sees the gradients
            mine += self.local_grads.check((p.grad for _, p in self._params(model_parts)), step=step,
                                           rank=self.rank, judge=True)
        mine += self._compute_checks(step, judge=True)
        at_rest, at_rest_step = self._at_rest_check(step, model_parts)   # the hashes of the last due step, if any
        mine += at_rest
        mine += self._probe_suspicions(step)
        lval = float(loss) if loss is not None else None
        tables = [chk.local_rows() for chk in self.reductions] if fused else []
        scalars = self._exchange_scalars(lval, len(mine), tables, share=self._gemm_share())
        agreed = []   # judged from the gathered tables: identical on every rank already
        off = 4
        for chk, t in zip(self.reductions if fused else [], tables):
            k = t.numel()
            agreed += chk.judge(step, scalars[:, off:off + k].reshape(self.world, *t.shape), judge_spikes=True)
            off += k
        scalars = scalars[:, :4]
        self._note_losses(scalars)
        loss_sus = self._loss_checks(step, scalars, judge=grads_due)
        sus = mine
        if scalars[:, 2].max() > 0:
            sus, _ = self._agree(mine)
        sus = self._finish(step, sorted(reached_the_step(sus + agreed + loss_sus),
                                        key=lambda s: (s.rank, s.kind, s.tensor)))
        self._gemms_sampled(step, scalars[:, 3], sus)
        if at_rest_step is not None and not any(s.kind in AT_REST_KINDS and not s.harmless for s in sus):
            self._last_verified = max(self._last_verified, at_rest_step)   # that version's parameters held
        if not sus:
            return Decision()
        real = [s for s in sus if not s.harmless]
        if not real:
            return self._harmless(sus)
        probed = sorted({s.rank for s in real if s.kind == KIND_PROBE})
        if probed:   # a wrong known answer is direct evidence of a bad device
            d = Decision(suspicions=sus, verdicts={r: Verdict.PERSISTENT for r in probed}, devices=dict(self._devices()))
            for r in probed:
                self._emit("sdc_verdict", step=step, suspect_rank=r, device=self._devices().get(r, ""),
                           verdict="persistent", kinds=[KIND_PROBE])
            return self._quarantine(step, d, probed)
        at_rest = [s for s in real if s.kind in AT_REST_KINDS]
        if at_rest:
            # a corrupted parameter poisons every rank's forward (NaN losses, mismatches
            # downstream): the ranks whose memory changed are the cause, the rest consequences
            return self._rollback(step, at_rest, suspicions=sus)
        if not self.cfg.replay:
            return self._rollback(step, real)
        self.sm.suspect(step, real, fingerprint((n, p.grad) for n, p in _named_params(model_parts)))
        self.sm.begin()
        for chk in self.reductions:
            chk.reset()
        self._emit("sdc_replay", step=step, suspects=sorted({s.rank for s in real}), replay=self.sm.replays)
        return Decision(action=Action.REPLAY, suspicions=sus, devices=dict(self._devices()))

    @_timed
    @torch.no_grad()
    def after_replay(self, step: int, model_parts: Parts, loss: torch.Tensor | float | None) -> Decision:
        """Verdicts for the step recomputed after a REPLAY decision (collective)."""
        original = self.sm.suspicions
        mine = [s for s in self._grad_checks(step, judge=False) + self._compute_checks(step, judge=False)
                if not s.harmless]
        lval = float(loss) if loss is not None else None
        scalars = self._exchange_scalars(lval, len(mine))
        self._note_losses(scalars)
        mine += [s for s in self._loss_checks(step, scalars, judge=False) if s.rank == self.rank]
        fp = fingerprint((n, p.grad) for n, p in _named_params(model_parts))
        match, detail = compare(self.sm.original, fp)
        replay_sus, extras = self._agree(mine, (self.rank, match.value, detail))
        matches = {r: Match(m) for r, m, _ in extras}
        details = {r: d for r, _, d in extras}
        still = {s.rank for s in replay_sus if s.kind in EXACT_KINDS or s.kind == KIND_NONFINITE}
        # a rank the cross-device replay attributed (two other devices agree against it) that
        # gives its wrong answer again on its own device computes wrong: still suspect. A tie
        # (two devices, no majority) never is: replay tells a transient, nothing else acts.
        still |= {s.rank for s in original if s.kind == KIND_CROSS and s.evidence.get("attributed")
                  and matches.get(s.rank) is Match.SAME}
        involved = sorted({s.rank for s in original} | still)
        # reproducible answers are settled by a known-answer probe on the device
        reproducible = [r for r in involved if matches[r] is Match.SAME]
        probe_failed = self._probe_ranks(step, reproducible)
        per_rank = {}
        for r in involved:
            kinds = {s.kind for s in original + replay_sus if s.rank == r}
            s_still = r in still
            if matches[r] is Match.SAME:
                if r in probe_failed:
                    s_still = True
                elif kinds <= {KIND_NONFINITE, KIND_LOSS_SPIKE, "grad_spike", KIND_ACTIVATION_SPIKE}:
                    s_still = False   # reproducible data/model behaviour on a device that passes probes
            per_rank[r] = (matches[r], s_still)
        if probe_failed:  # a probe singled out the bad device of a tie (two replicas, no majority)
            for r in involved:
                tie = [s for s in original if s.rank == r and s.kind == KIND_REPLICA and s.evidence.get("majority_bits") is None]
                if r not in probe_failed and tie and per_rank[r] == (Match.SAME, True) and r not in self._other_kinds(r, original):
                    per_rank[r] = (Match.SAME, False)
        verdicts = self.sm.conclude(per_rank, self._devices())
        for r, v in verdicts.items():
            self._emit("sdc_verdict", step=step, suspect_rank=r, device=self._devices().get(r, ""), verdict=v.value,
                       match=matches[r].value, still_suspect=per_rank[r][1], probe_failed=r in probe_failed,
                       detail=details.get(r, {}))
        bad = sorted(r for r, v in verdicts.items() if v is Verdict.PERSISTENT)
        # a gradient fault never reached the parameters: the pre-step version is clean
        d = Decision(suspicions=original + replay_sus, verdicts=verdicts, devices=dict(self._devices()),
                     rollback_to=step - 1)
        if bad:
            if any(s.kind == KIND_CROSS and s.rank in bad for s in original):
                # a device that computes wrong did so since the last clean sample at the latest
                d.rollback_to = min(d.rollback_to, self.cross_clean_step)
            if self.gemm_steps is not None and any(s.kind == KIND_GEMM and s.rank in bad for s in original):
                d.rollback_to = min(d.rollback_to, self.gemm_clean_step)   # sampled: it may have struck since
            return self._quarantine(step, d, bad)
        return d

    @_timed
    @torch.no_grad()
    def after_optimizer_step(self, step: int, model_parts: Parts) -> Decision:
        """Record parameters (every ``param_check_every``) and optimizer state (every
        ``state_check_every``) at rest; compare replicated parameters."""
        now = time.perf_counter()
        if self._t_step_end is not None and self.gemms is not None and not self.gemms.armed:
            self._plain_step_s = now - self._t_step_end   # what a sampled step's checks are a share of
        self._t_step_end = now
        self._arm_after(step)
        params_due = self._due(step, self.cfg.param_check_every)
        self.resting.record(step, self._params(model_parts), params=params_due,
                            state=self._due(step, self.cfg.state_check_every))
        if not params_due:
            return Decision()
        self._devices()
        psets = [rs for rs in self.replicas if rs.what == "param"]
        if not psets:
            return Decision()
        mine = []
        for rs in psets:
            mine += compare_replicas(rs.tensors(), rs.group, step=step)
        scalars = self._exchange_scalars(None, len(mine))
        if scalars[:, 2].max() == 0:
            return Decision()
        sus, _ = self._agree(mine)
        sus = self._finish(step, sus)
        real = [s for s in sus if not s.harmless]
        if not real:
            return self._harmless(sus)
        # the step already ran: its result cannot be replayed from here; go back
        return self._rollback(step, real, rollback_to=self._last_verified)

    # ---- outcomes ----------------------------------------------------------
    def _harmless(self, sus: list[Suspicion]) -> Decision:
        verdicts = {s.rank: Verdict.HARMLESS for s in sus}
        for s in sus:
            self._emit("sdc_verdict", step=s.step, suspect_rank=s.rank, device=s.device, verdict="harmless",
                       kind=s.kind, tensor=s.tensor, evidence=s.evidence)
        return Decision(action=Action.CONTINUE, suspicions=sus, verdicts=verdicts, devices=dict(self._devices()))

    def _rollback(self, step: int, real: list[Suspicion], rollback_to: int | None = None,
                  suspicions: list[Suspicion] | None = None) -> Decision:
        """A fault already applied to state: roll back; repeat offenders are quarantined."""
        devs = self._devices()
        ranks = sorted({s.rank for s in real})
        verdicts, bad = {}, []
        for r in ranks:
            escalate = self.sm.record_transient(devs.get(r, f"rank{r}"))
            verdicts[r] = Verdict.PERSISTENT if escalate else Verdict.TRANSIENT
            if escalate:
                bad.append(r)
            self._emit("sdc_verdict", step=step, suspect_rank=r, device=devs.get(r, ""), verdict=verdicts[r].value,
                       kinds=sorted({s.kind for s in real if s.rank == r}))
        to = self._last_verified if rollback_to is None else rollback_to
        d = Decision(action=Action.ROLLBACK, suspicions=suspicions if suspicions is not None else real,
                     verdicts=verdicts, devices=dict(devs), rollback_to=to)
        if bad:
            return self._quarantine(step, d, bad)
        self._emit("rollback", step=step, to_step=to, reason="sdc", suspects=ranks)
        self.resting.clear()
        return d

    def _quarantine(self, step: int, d: Decision, bad: list[int]) -> Decision:
        devs = self._devices()
        d.action, d.quarantine = Action.QUARANTINE, bad
        d.rollback_to = self._last_verified if d.rollback_to is None else d.rollback_to
        for r in bad:
            self._emit("quarantine", step=step, suspect_rank=r, device=devs.get(r, ""), reason="sdc persistent")
        self._emit("rollback", step=step, to_step=d.rollback_to, reason="sdc quarantine", suspects=bad)
        self.resting.clear()
        return d

    def _probe_ranks(self, step: int, ranks: list[int]) -> set[int]:
        """Run the on-demand probes on ``ranks`` (each on its own device); the set that failed."""
        if not ranks:
            return set()
        ok = True
        if self.rank in ranks:
            ok = all(r.ok for r in self.prober.run_once(f"suspect step {step}"))
            self._probe_seen = len(self.prober.results)   # judged here, not again by the next hook
        flags = self._exchange_scalars(None, 0 if ok else 1)
        failed = {r for i, r in enumerate(self.granks) if r in ranks and flags[i, 2] > 0}
        return failed

    @staticmethod
    def _other_kinds(r: int, sus: list[Suspicion]) -> set[int]:
        """{r} if rank r is suspected by anything but a tied replica comparison."""
        return {r} if any(s.rank == r and not (s.kind == KIND_REPLICA and s.evidence.get("majority_bits") is None)
                          for s in sus) else set()

    def overhead_seconds(self, cpu: bool = False) -> float:
        """Seconds spent so far in the hooks and in the reduce-scatter wrappers' sums:
        wall clock, or process CPU time with ``cpu`` (on CUDA: host time to launch
        the sums, which run on FSDP's stream)."""
        parts = [self._spent] + [u.spent for chk in self.reductions for u in chk.units]
        return sum(p.cpu if cpu else p.wall for p in parts)

    def raise_if_fatal(self, d: Decision) -> None:
        """For loops that cannot roll back: turn a QUARANTINE into :class:`SdcDetected`."""
        if d.action is Action.QUARANTINE:
            r = d.quarantine[0]
            kinds = sorted({s.kind for s in d.suspicions if s.rank == r}) or [KIND_PROBE]
            step = min((s.step for s in d.suspicions), default=-1)
            raise SdcDetected(r, d.devices.get(r, ""), ",".join(kinds), step)

    @property
    def last_verified(self) -> int:
        """The newest step whose state the at-rest checks verified clean (-1: the initial
        state): where a rollback would go back to."""
        return self._last_verified

    def note_restored(self, step: int, model_parts: Parts | None = None) -> None:
        """Tell the monitor the loop restored (or initialized) the state of ``step``: the
        at-rest hashes start from it, so a flip before the first step after a start or a
        rollback is caught like any other, and the next step's checks are armed if due."""
        self.resting.clear()
        self._last_verified = step
        # what the sampled checks found clean was of the steps before: no rollback goes past this one
        self.cross_clean_step = self.gemm_clean_step = step
        if self.gemm_steps is not None:
            self.gemm_steps.starting_at(step)
        self._t_step_end = None
        if model_parts is not None and self.cfg.enable:
            self.resting.record(step, self._params(model_parts), params=self.cfg.param_check_every > 0,
                                state=self.cfg.state_check_every > 0)
        self._arm_after(step)
