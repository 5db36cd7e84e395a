"""The worker's training loop: one orchestrator that wires the components.

A worker process is started by ``resilient launch`` (or torchrun) with the
usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` environment. :class:`Trainer`
builds the process group, the (pp, dp, tp) layout, this rank's share of the
GPT, the optimizer and the data, then loops: batch → forward/backward →
clip → optimizer step → log. Components are configured by the dataclasses of
:mod:`resilient.config`; this module only orders them.

What a step sees depends only on (config, step): data by global sample index,
learning rate by step, initialization by (seed, name). That is what makes two
runs of one layout bitwise identical and a restored run continue exactly.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from resilient.agent.api import NOT_DURABLE_EXIT
from resilient.agent.heartbeat import HeartbeatWriter
from resilient.agent.quarantine import QUARANTINE_EXIT
from resilient.config import Config
from resilient.data import TokenCorpus, ensure_corpus
from resilient.events import EventLog
from resilient.model import flops_per_token, init_parameters
from resilient.optim import Optimizers, clip_grad_norm, lr_at
from resilient.parallel import ParallelModel, build_layout, build_model
from resilient.progress import ProgressLine, device_peak_tflops
from resilient.sdc.api import Action, SdcError
from resilient.sdc.inject import BitFlipInjector, FlipSpec
from resilient.sdc.monitor import SdcMonitor
from resilient.sdc.reduction import pipeline_post_scale
from resilient.snapshot.api import StorageError
from resilient.train_state import Marks, TrainState

DIST_TIMEOUT = timedelta(minutes=5)


class RollbackNeeded(Exception):
    """Raised inside a step when the SDC monitor decided to roll back."""

    def __init__(self, decision):
        super().__init__(decision.action.value)
        self.decision = decision


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float
    seconds: float


def pick_device(cfg: Config) -> tuple[torch.device, str]:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "cpu:gloo,cuda:nccl"
    return torch.device("cpu"), "gloo"


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    d = cfg.train.dtype
    if d == "auto":
        d = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if d == "bf16" else torch.float32


def param_digest(pm: ParallelModel) -> str:
    """SHA-256 of this rank's local parameter bytes, in name order: equal
    digests on every rank of two runs of one layout = bitwise-equal models."""
    h = hashlib.sha256()
    for name, p in sorted(pm.named_parameters(), key=lambda kv: kv[0]):
        local = p.to_local() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Trainer:
    """Trains ``cfg`` as this process's rank; see the module docstring."""

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, node: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # Where a worker's start goes (run_start's ``startup``): a restart's recovery waits for it.
        self.startup: dict[str, float] = {}
        mark = Marks(self.startup)
        self.device, backend = pick_device(cfg)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=DIST_TIMEOUT)
        self.rank = dist.get_rank()
        mark("process_group")
        self.events = EventLog(self.run_dir / "events.jsonl", node=node, rank=self.rank)
        torch.manual_seed(cfg.train.seed)
        self.layout = build_layout(cfg, self.device.type)
        self.dtype = compute_dtype(cfg, self.device)
        # Initialized in restore(), only when there is nothing to restore.
        self.model = build_model(cfg, self.layout, self.device, self.dtype, init=False)
        self.optimizer = Optimizers(self.model.parts, cfg.train)
        mark("model")
        corpus_path = ensure_corpus(cfg.data.path, cfg.data.source, cfg.data.max_bytes) if self.rank == 0 else None
        dist.barrier()  # rank 0 may have just built the corpus
        self.corpus = TokenCorpus(corpus_path or Path(cfg.data.path).expanduser(), cfg.train.seq_len,
                                  cfg.train.seed, cfg.data.val_fraction)
        self.corpus.check_vocab(cfg.model.vocab_size, cfg.source)
        mark("data")
        self.sdc = self._build_sdc()
        self.flips = [BitFlipInjector(FlipSpec.from_dict(dict(d)), self.rank,
                                      log=lambda rec: self.events.emit("fault_injected", **rec),
                                      node=node or "", local_rank=int(os.environ.get("LOCAL_RANK", "0")))
                      for d in cfg.sdc.inject]
        for flip in self.flips:   # activation flips fire from a forward hook on the module they name
            flip.validate(self.model.parts, self.layout.world)
            if flip.spec.target == "activation" and flip.here():
                part = next((m for m in self.model.parts if flip.spec.tensor in dict(m.named_modules())), None)
                if part is None:
                    raise SdcError(f"sdc.inject: no module {flip.spec.tensor!r} on rank {self.rank} for an activation flip")
                flip.attach(part)
        self.heartbeat = HeartbeatWriter.from_env()
        mark("sdc")
        self.state = TrainState(cfg, self.run_dir, self.model, self.optimizer, self.events)
        mark("snapshots")  # the optimizer's state and the snapshot writers
        self.startup.update({f"snapshots.{k}": v for k, v in self.state.setup_timings.items()})
        # Completed steps; the next step to run is self.step + 1 and its first
        # global sample is self.step × global_batch (the data position).
        self.step = 0
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.chaos = None
        if os.environ.get("RESILIENT_CHAOS_CONTROL"):  # set only by `resilient chaos run`
            from resilient_chaos.hooks import WorkerHooks

            self.chaos = WorkerHooks.attach(self)  # turns bit-flip requests into self.flips
        self.progress = ProgressLine(cfg.train.steps, every=cfg.train.log_every) if self.rank == 0 else None
        peak = cfg.train.peak_tflops or device_peak_tflops(self.device.type)
        self.peak_flops = peak * 1e12 * self.layout.world if peak else 0.0

    def _build_sdc(self) -> SdcMonitor | None:
        if not self.cfg.sdc.enable:
            return None
        monitor = SdcMonitor(self.cfg.sdc, events=self.events, device=self.device)
        monitor.watch_optimizer(self.optimizer)   # Adam state at rest: hashed after a step, verified before the next
        if self.layout.dp > 1:
            # Linear checks of FSDP2's reduce-scatters. A pipeline schedule reduces
            # once per stage after the last micro-batch, then divides the reduced
            # gradients by the micro-batch count: the check must expect that.
            monitor.watch_fsdp(self.model.parts, post_scale=pipeline_post_scale(self.model.schedule))
        if self.layout.tp > 1:
            # Norm weights are replicated across tp: their gradients must agree bitwise.
            norms = [(n, p) for n, p in self.model.named_parameters() if n.endswith("norm.weight")]
            monitor.watch_replicas("tp-norms", lambda: [(n, p.grad) for n, p in norms],
                                   self.layout.mesh["tp"].get_group())
            # ... and so must the norm weights after the optimizer step: this is where a flip in
            # their (replicated) Adam state, or in its update on one tp rank, shows
            monitor.watch_replicas("tp-norm-params", lambda: norms, self.layout.mesh["tp"].get_group(), what="param")
        return monitor

    # -- one step -----------------------------------------------------------
    def _batch(self, step: int):
        lay = self.layout
        b = self.corpus.batch(step, self.cfg.train.global_batch, lay.dp_rank, lay.dp)
        return b.inputs.to(self.device), b.targets.to(self.device)

    def _global_mean(self, local: torch.Tensor | None) -> float:
        """Mean of a per-replica loss over dp, available on every rank: last-stage
        ranks with tp_rank 0 contribute, everyone else adds zero."""
        lay = self.layout
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if local is not None and lay.tp_rank == 0:
            value += local.double()
        dist.all_reduce(value)
        return float(value) / lay.dp

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        step, cfg = self.step, self.cfg.train
        self.optimizer.set_lr(lr_at(step, cfg))
        # Flips "at rest" strike between steps: after step `step` was recorded
        # and saved, before the next one reads the parameters.
        self._inject(step, "param", "optim_state")
        inputs, targets = self._batch(step)
        for flip in self.flips:
            flip.current_step = step + 1  # activation flips fire inside forward
        local_loss = self.model.forward_backward(inputs, targets)
        if self.sdc is not None:
            local_loss = self._check_gradients(step + 1, inputs, targets, local_loss)
        else:
            self._inject(step + 1, "grad")
        norm = clip_grad_norm(list(self.model.parameters()), cfg.grad_clip, self.layout.dp * self.layout.tp)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.sdc is not None:
            self._act_on(self.sdc.after_optimizer_step(step + 1, self.model.parts))
            self.state.keep_verified(self.sdc.last_verified)
        # the SDC exchange already gathered every rank's loss: no second collective for the log
        loss = self.sdc.loss_mean if self.sdc is not None and self.sdc.loss_mean is not None else (
            self._global_mean(local_loss))
        self.step += 1
        seconds = time.perf_counter() - t0
        tokens = cfg.global_batch * cfg.seq_len
        # Steps are counted as completed steps: event "step": 1 is the first.
        return StepResult(self.step, loss, float(norm), tokens / seconds, seconds)

    def _inject(self, step: int, *targets: str) -> None:
        for flip in self.flips:
            if flip.spec.target in targets:
                flip.maybe_inject(step, self.model, self.optimizer)

    def _check_gradients(self, step: int, inputs, targets, local_loss):
        """SDC checks after backward, before clipping (which would rescale
        what the linear check compares). A suspect step is recomputed on the
        same batch; the monitor compares the answers and decides."""
        self._inject(step, "grad")
        decision = self.sdc.after_backward(step, self.model.parts, local_loss)
        while decision.action is Action.REPLAY:
            self.optimizer.zero_grad()
            local_loss = self.model.forward_backward(inputs, targets)
            self._inject(step, "grad")  # a persistent fault strikes the replay too
            decision = self.sdc.after_replay(step, self.model.parts, local_loss)
        self._act_on(decision)
        return local_loss

    def _act_on(self, decision) -> None:
        if decision.action in (Action.ROLLBACK, Action.QUARANTINE):
            raise RollbackNeeded(decision)

    @torch.no_grad()
    def evaluate(self) -> float:
        total = 0.0
        lay = self.layout
        for i in range(self.cfg.train.eval_batches):
            b = self.corpus.val_batch(i, self.cfg.train.global_batch, lay.dp_rank, lay.dp)
            local = self.model.evaluate(b.inputs.to(self.device), b.targets.to(self.device))
            total += self._global_mean(local)
        return total / self.cfg.train.eval_batches

    # -- the loop -----------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        # Preemption notice: finish the step in flight, save it, leave.
        self.stop_requested = True

    def _rollback(self, decision) -> None:
        """Corruption was confirmed during step self.step + 1: nothing of that
        step was saved (the check runs before its optimizer step), so the
        newest complete version is clean. Load it and train on from there."""
        self.optimizer.zero_grad()
        self.state.wait_idle()
        if decision.action is Action.QUARANTINE:
            # A bad device: its worker leaves with the exit code that tells its
            # agent to quarantine the node; everyone else leaves too, so the
            # agents re-form without that node (a spare takes its place) and
            # every rank restores the last clean version: the newer ones are
            # gone before anyone leaves (the barrier), so none can be restored.
            if decision.rollback_to is not None:
                self.state.abandon_after(decision.rollback_to)
            if dist.is_initialized():
                dist.barrier()
            if self.rank in decision.quarantine:
                raise SystemExit(QUARANTINE_EXIT)
            raise SystemExit(1)
        # The monitor's bound: versions after it may hold the corruption.
        restored = self.state.restore(max_step=decision.rollback_to)
        self.step = restored.step if restored is not None else 0
        self.state.abandon_after(self.step)
        if restored is None:  # nothing saved yet: start over from the seed
            for part in self.model.parts:
                init_parameters(part, self.cfg.train.seed)
            self.optimizer.reset()
        self.events.emit("rollback", to_step=self.step, reason=decision.action.value,
                         suspects=sorted({s.rank for s in decision.suspicions}))
        self.sdc.note_restored(self.step, self.model.parts)

    def restore(self) -> None:
        """Restore the newest version, or initialize the parameters from the seed on a fresh
        run (the model was built uninitialized: see :func:`~resilient.parallel.build_model`)."""
        t0 = time.perf_counter()
        restored = self.state.restore(fresh=True)
        if restored is None:
            for part in self.model.parts:
                init_parameters(part, self.cfg.train.seed)
        self.startup["restore" if restored is not None else "init"] = round(time.perf_counter() - t0, 4)
        self.startup.update({f"restore.{k}": v for k, v in self.state.timings.items()})
        if restored is not None:
            self.step = restored.step
            if self.progress:
                self.progress.message(f"restored step {restored.step} from {restored.url} "
                                      f"({'resharded, ' if restored.resharded else ''}{time.perf_counter() - t0:.2f}s)")
        if self.sdc is not None:   # the at-rest hashes start here (restored or initialized)
            self.sdc.note_restored(self.step, self.model.parts)

    def _log_step(self, r: StepResult) -> None:
        mfu = None
        if self.peak_flops:
            fpt = flops_per_token(self.cfg.model, self.cfg.train.seq_len)
            mfu = r.tokens_per_s * fpt / self.peak_flops
        self.events.emit("step", step=r.step, loss=r.loss, grad_norm=r.grad_norm,
                         tokens_per_s=r.tokens_per_s, seconds=r.seconds, **({"mfu": mfu} if mfu else {}))
        if self.progress:
            if self.progress.due(r.step):
                tiers = self.state.committed()
                self.progress.set("committed", " ".join(f"{t} {tiers[t]}" for t in ("local", "peer", "durable")
                                                        if t in tiers) or "none yet")
            self.progress.update(r.step, r.loss, r.tokens_per_s, mfu)

    def run(self) -> int:
        cfg = self.cfg
        self.restore()
        self.events.emit("run_start", layout=self.layout.as_dict(), start_step=self.step,
                         config_digest=cfg.digest(), params=cfg.model.num_params(),
                         device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                         threads=torch.get_num_threads(), startup=self.startup)
        self.heartbeat.beat()
        last = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
        while self.step < last and not self.stop_requested:
            try:
                result = self.train_step()
            except RollbackNeeded as rb:
                self._rollback(rb.decision)
                continue
            self.heartbeat.beat()
            self._log_step(result)
            self.state.after_step(self.step)
            if cfg.train.eval_every and result.step % cfg.train.eval_every == 0:
                val = self.evaluate()
                self.events.emit("eval", step=result.step, val_loss=val)
                if self.progress:
                    self.progress.message(f"eval at step {result.step}: val loss {val:.4f}")
        if self.progress:
            self.progress.close()
        with self.heartbeat.while_waiting():
            try:
                self.state.final(self.step)
            except StorageError as e:
                self.events.emit("worker_error", error=f"{type(e).__name__}: {e}", traceback="")
                raise SystemExit(NOT_DURABLE_EXIT) from e
        if self.stop_requested:
            self.events.emit("run_end", step=self.step, preempted=True)
            return 0
        self.events.emit("run_end", step=self.step, param_digest=param_digest(self.model))
        return 0

    def close(self, failed: bool = False) -> None:
        """``failed``: the run ended in an error (see :meth:`TrainState.close`)."""
        if self.chaos is not None:
            self.chaos.close()
        with self.heartbeat.while_waiting():
            self.state.close(failed)
            if self.sdc is not None:
                self.sdc.close()
        self.events.close()
        # No destroy_process_group(): with a peer gone it can block, and the
        # worker process ends right after this (os._exit in resilient.worker).
