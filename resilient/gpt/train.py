"""The worker's training loop: one orchestrator that wires the components.

A worker process is started by ``resilient launch`` (or torchrun) with the
usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` environment. :class:`Trainer`
builds the process group, the (pp, dp, tp) layout, this rank's share of the
GPT, the optimizer and the data, then loops: batch → forward/backward →
clip → optimizer step → log. Components are configured by the dataclasses of
:mod:`resilient.gpt.config`; this module only orders them.

What a step sees depends only on (config, step): data by global sample index,
learning rate by step, initialization by (seed, name). That is what makes two
runs of one layout bitwise identical and a restored run continue exactly.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from resilient.gpt.config import Config
from resilient.gpt.data import TokenCorpus, ensure_corpus
from resilient.job import Job, JobOptions, Marks, device_peak_tflops, pipeline_post_scale
from resilient.gpt.model import flops_per_token, init_parameters
from resilient.gpt.optim import Optimizers, clip_grad_norm, lr_at
from resilient.gpt.parallel import build_layout, build_model

DIST_TIMEOUT = timedelta(minutes=5)


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


class Trainer:
    """Trains ``cfg`` as this process's rank; see the module docstring.

    Everything that outlives a step — snapshots in every tier, restore, the SDC checks,
    heartbeats, preemption, the event log — comes from :class:`resilient.Job`, the
    public API a user's script uses; this class only builds the GPT and runs its steps."""

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, node: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # Where a worker's start goes (run_start's ``startup``): a restart's recovery waits for it.
        startup: dict[str, float] = {}
        mark = Marks(startup)
        self.device, backend = pick_device(cfg)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=DIST_TIMEOUT)
        self.rank = dist.get_rank()
        mark("process_group")
        torch.manual_seed(cfg.train.seed)
        self.layout = build_layout(cfg, self.device.type)
        self.dtype = compute_dtype(cfg, self.device)
        # Initialized by the Job's restore, only when there is nothing to restore.
        self.model = build_model(cfg, self.layout, self.device, self.dtype, init=False)
        self.optimizer = Optimizers(self.model.parts, cfg.train)
        mark("model")
        corpus_path = ensure_corpus(cfg.data.path, cfg.data.source, cfg.data.max_bytes) if self.rank == 0 else None
        dist.barrier()  # rank 0 may have just built the corpus
        self.corpus = TokenCorpus(corpus_path or Path(cfg.data.path).expanduser(), cfg.train.seq_len,
                                  cfg.train.seed, cfg.data.val_fraction)
        self.corpus.check_vocab(cfg.model.vocab_size, cfg.source)
        mark("data")
        lay = self.layout
        self.job = Job(self.model.parts, self.optimizer.optimizers, run_dir=self.run_dir, config=cfg, options=JobOptions(
            node=node, device=self.device, layout=lay.as_dict(), config_digest=cfg.digest(), run_info=self._run_info,
            reinit=self._reinit, fresh_model=True,
            # AdamW's hyperparameters come from the config and the step (lr_at), not the snapshot
            param_groups=False,
            # FSDP2 shards over dp only; its reductions are checked where there are several
            watch_fsdp=lay.dp > 1, post_scale=pipeline_post_scale(self.model.schedule),
            log_every=cfg.train.log_every,
            describe={"config_digest": cfg.digest(), "params": cfg.model.num_params(),
                      "dtype": str(self.dtype).removeprefix("torch."), "threads": torch.get_num_threads()},
            startup=startup))
        if self.job.sdc is not None and lay.tp > 1:
            # Norm weights are replicated across tp: their gradients must agree bitwise ...
            norms = [(n, p) for n, p in self.model.named_parameters() if n.endswith("norm.weight")]
            group = lay.mesh["tp"].get_group()
            self.job.sdc.watch_replicas("tp-norms", lambda: [(n, p.grad) for n, p in norms], group)
            # ... and so must the norm weights after the optimizer step: this is where a flip in
            # their (replicated) Adam state, or in its update on one tp rank, shows
            self.job.sdc.watch_replicas("tp-norm-params", lambda: norms, group, what="param")
        peak = cfg.train.peak_tflops or device_peak_tflops(self.device.type)
        self.peak_flops = peak * 1e12 * lay.world if peak else 0.0

    @property
    def step(self) -> int:
        """Completed steps; the next step's first global sample is step × global_batch."""
        return self.job.step

    @property
    def events(self):
        return self.job.events

    def _run_info(self, step: int) -> dict:
        """Saved with each version: the data position, and the model's shape so tools
        (``resilient ckpt reshard``) can check a target layout without our config file."""
        return {"sample_index": step * self.cfg.train.global_batch,
                "config": {"model": dataclasses.asdict(self.cfg.model)}}

    def _reinit(self) -> None:
        """The model from the seed, the optimizer fresh: a new run, or a rollback with no version."""
        for part in self.model.parts:
            init_parameters(part, self.cfg.train.seed)
        self.optimizer.reset()

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

    def train_step(self, step: int) -> StepResult | None:
        """Step ``step + 1`` (``step`` completed). None when the SDC checks rolled back."""
        t0 = time.perf_counter()
        cfg = self.cfg.train
        self.optimizer.set_lr(lr_at(step, cfg))
        with self.job.phase("data"):   # the fail-slow checks tell a slow loader from a slow device
            inputs, targets = self._batch(step)
        local_loss = self.model.forward_backward(inputs, targets)
        # The checks run after backward, before clipping (which would rescale what the linear
        # check compares); a suspect step is recomputed on the same batch.
        # Sampled steps are also recomputed on a neighbour's device: data parallel only (a
        # pipeline stage's or a tensor-parallel shard's forward is not one rank's loss)
        cross = {} if self.model.schedule is not None or self.layout.tp > 1 else {"batch": (inputs, targets),
                                                            "recompute": self.model.forward_loss}
        if not self.job.verify(local_loss, replay=lambda: self.model.forward_backward(inputs, targets), **cross):
            return None
        norm = clip_grad_norm(list(self.model.parameters()), cfg.grad_clip, self.layout.dp * self.layout.tp)
        self.optimizer.step()
        self.optimizer.zero_grad()
        sdc = self.job.sdc
        # the SDC exchange already gathers every rank's loss: no second collective for the log
        loss = None if sdc is not None else self._global_mean(self.job.last_local_loss)
        seconds = time.perf_counter() - t0
        tokens = cfg.global_batch * cfg.seq_len
        return StepResult(step + 1, loss, float(norm), tokens / seconds, seconds)

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
    def _record(self, r: StepResult) -> None:
        fields = {"grad_norm": r.grad_norm, "tokens_per_s": r.tokens_per_s, "seconds": r.seconds}
        if self.peak_flops:
            fields["mfu"] = r.tokens_per_s * flops_per_token(self.cfg.model, self.cfg.train.seq_len) / self.peak_flops
        self.job.record(loss=r.loss, **fields)

    def run(self) -> int:
        cfg = self.cfg.train
        last = min(cfg.stop_at or cfg.steps, cfg.steps)
        restored = self.job.restore()
        if restored and cfg.eval_every and restored % cfg.eval_every == 0 and self.job.restored is not None:
            # the lost run may have died between this step and its evaluation: no hole in the curve
            self._evaluate(restored)
        for step in self.job.steps(last, total=cfg.steps):
            result = self.train_step(step)
            if result is None:
                continue   # rolled back: the Job restored the last verified version
            self._record(result)
            if cfg.eval_every and result.step % cfg.eval_every == 0:
                self._evaluate(result.step)
        return 0

    def _evaluate(self, step: int) -> None:
        val = self.evaluate()
        self.events.emit("eval", step=step, val_loss=val)
        if self.job.progress:
            self.job.progress.message(f"eval at step {step}: val loss {val:.4f}")

    def close(self, failed: bool = False) -> None:
        """``failed``: the run ended in an error (see :meth:`Job.close`)."""
        self.job.close(failed)
        # No destroy_process_group(): with a peer gone it can block, and the
        # worker process ends right after this (os._exit in resilient.gpt.worker).
