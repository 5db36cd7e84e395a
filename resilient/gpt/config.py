"""Run configuration: TOML files loaded into typed, documented dataclasses.

A run config has one table per component::

    [model]     the GPT's shape
    [parallel]  the (pp, dp, tp) layout, ZeRO stage, pipeline schedule
    [train]     optimizer, schedule, batch, steps, precision
    [data]      the token corpus
    [snapshot]  capture, durable tier, retention (resilient.snapshot)
    [launch]    processes per node, restarts
    [sdc]       silent-data-corruption checks, replay, probes (resilient.sdc)

Every knob is declared with its documentation next to it; ``resilient config
--explain`` prints them all. Overrides from the command line use dotted keys:
``--set train.steps=100``. :meth:`Config.validate_layout` checks the
combinations that only make sense together (pp×dp×tp against the world size,
layers against stages, heads against tp) and names the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from resilient.configbase import check_bounds, explain, knob, load_section, section_to_dict
from resilient.errors import ConfigError
from resilient.runconfig import RuntimeConfig, read_config_table

PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble")
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble")  # several stages per rank


@dataclass
class ModelConfig:
    """Shape of the decoder-only GPT (RMSNorm, RoPE, SwiGLU, SDPA attention)."""

    vocab_size: int = knob(256, "tokens in the vocabulary; 256 for the byte-level tokenizer")
    dim: int = knob(128, "width of the residual stream")
    n_layers: int = knob(4, "transformer blocks; must divide evenly into pipeline stages")
    n_heads: int = knob(4, "attention heads; must be divisible by parallel.tp")
    ffn_dim: int = knob(0, "hidden width of the SwiGLU MLP; 0 = 8/3·dim rounded up to multiple_of")
    multiple_of: int = knob(32, "round the automatic ffn_dim up to a multiple of this")
    max_seq_len: int = knob(256, "longest sequence the rotary tables are built for")
    rope_theta: float = knob(10000.0, "rotary embedding base")
    norm_eps: float = knob(1e-5, "RMSNorm epsilon")
    init_std: float = knob(0.02, "std of the normal init of weights (output projections scaled by depth)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        h = int(8 * self.dim / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    def num_params(self) -> int:
        """Parameter count (embedding and output head untied)."""
        d, h, v = self.dim, self.hidden_dim, self.vocab_size
        per_layer = 4 * d * d + 3 * d * h + 2 * d
        return v * d + self.n_layers * per_layer + d + d * v


@dataclass
class ParallelConfig:
    """The (pp, dp, tp) layout. World size = pp × dp × tp."""

    pp: int = knob(1, "pipeline-parallel stages (ranks along the pipeline)")
    dp: int = knob(0, "data-parallel replicas sharded by FSDP2; 0 = world_size / (pp·tp), so the job follows elastic resizes")
    tp: int = knob(1, "tensor-parallel ranks (DTensor column/row-wise plans)")
    zero: int = knob(3, "ZeRO stage of FSDP2: 3 reshards parameters after forward (least memory), 2 keeps them gathered (faster, +2 bytes/param in bf16)", choices=(2, 3))
    pp_schedule: str = knob("1f1b", "pipeline schedule", choices=PP_SCHEDULES)
    stages_per_rank: int = knob(1, "virtual pipeline stages per pp rank; >1 only with interleaved-1f1b")
    microbatches: int = knob(0, "pipeline micro-batches per step; 0 = 2·pp (or 1 without pp)")
    activation_checkpoint: bool = knob(False, "recompute each block's activations in backward: saves ~activations, costs ~1/3 more compute")

    @property
    def n_microbatches(self) -> int:
        if self.microbatches:
            return self.microbatches
        return 2 * self.pp * self.stages_per_rank if self.pp > 1 else 1


@dataclass
class TrainConfig:
    """Optimizer, schedule, batch and precision."""

    steps: int = knob(100, "optimizer steps to train for; the learning-rate schedule spans them")
    stop_at: int = knob(0, "end this launch after this step (0 = train.steps) without changing the schedule: run a job in segments")
    global_batch: int = knob(16, "sequences per step across all data-parallel ranks; fixed, so dp changes micro-batching, not the samples a step sees")
    seq_len: int = knob(128, "tokens per sequence (≤ model.max_seq_len)")
    lr: float = knob(3e-3, "peak learning rate after warmup")
    min_lr: float = knob(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = knob(10, "linear warmup steps")
    weight_decay: float = knob(0.1, "AdamW decoupled weight decay")
    beta1: float = knob(0.9, "AdamW beta1")
    beta2: float = knob(0.95, "AdamW beta2")
    grad_clip: float = knob(1.0, "clip the global gradient norm to this; 0 disables")
    optimizer_impl: str = knob("fused", "AdamW's implementation: fused (one kernel per parameter group and step), foreach (one per operation), or for-loop (one tensor at a time, torch's reference); each is deterministic, their bits differ", choices=("fused", "foreach", "for-loop"))
    eval_every: int = knob(0, "evaluate the validation loss every N steps; 0 disables")
    eval_batches: int = knob(2, "global batches in one evaluation")
    seed: int = knob(1234, "seed of the model init and of the data order")
    dtype: str = knob("auto", "compute dtype: bf16 with fp32 master weights, or fp32; auto = bf16 on GPU, fp32 on CPU", choices=("auto", "fp32", "bf16"))
    log_every: int = knob(1, "print the progress line every N steps")
    device: str = knob("auto", "auto = cuda with nccl when GPUs exist, else cpu with gloo", choices=("auto", "cpu", "cuda"))
    peak_tflops: float = knob(0.0, "the device's peak dense TFLOP/s for MFU; 0 = look it up for known GPUs, none on CPU")


@dataclass
class DataConfig:
    """The token corpus: flat binary files of token ids, read through memmap."""

    path: str = knob("", "corpus directory written by `resilient data prepare` (~ is expanded)")
    source: str = knob("", "when the corpus is missing, build it from this text: 'python-stdlib' (ships with Python) or a path to text files")
    val_fraction: float = knob(0.05, "share of the tokens held out for the validation loss")
    max_bytes: int = knob(0, "cap on the text read when building the corpus; 0 = all")


@dataclass
class Config(RuntimeConfig):
    """A whole run config: the runtime's sections ([snapshot], [launch], [sdc]) and the
    GPT's own. ``source`` names the file it was read from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def digest(self) -> str:
        """A hash of what determines the model's structure (not the schedule)."""
        blob = json.dumps(section_to_dict(self.model), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def job_digest(self) -> str:
        """A hash of what every node of one job must agree on: the model, the layout, the
        schedule, the data and the SDC checks. Not ``launch`` (a node's own process knobs)
        nor ``snapshot`` (a node's store address): those may differ per node."""
        d = self.to_dict()
        blob = json.dumps({k: d[k] for k in ("model", "parallel", "train", "data", "sdc")}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def default_world_size(self) -> int:
        """Processes the layout asks for when launched on one node."""
        p = self.parallel
        return self.launch.nproc_per_node or p.pp * max(p.dp, 1) * p.tp

    def layout(self, world_size: int) -> tuple[int, int, int]:
        """(pp, dp, tp) for ``world_size`` ranks, after validation."""
        self.validate_layout(world_size)
        p = self.parallel
        return p.pp, (p.dp or world_size // (p.pp * p.tp)), p.tp

    def _validate_counts(self) -> None:
        """Sizes and counts must be positive before anything divides by them:
        ``--set model.n_heads=0`` would otherwise end in a ZeroDivisionError."""
        m, p, t, src = self.model, self.parallel, self.train, self.source
        at_least_one = (
            ("model.vocab_size", m.vocab_size), ("model.dim", m.dim), ("model.n_layers", m.n_layers),
            ("model.n_heads", m.n_heads), ("model.multiple_of", m.multiple_of),
            ("model.max_seq_len", m.max_seq_len), ("parallel.pp", p.pp), ("parallel.tp", p.tp),
            ("parallel.stages_per_rank", p.stages_per_rank), ("train.global_batch", t.global_batch),
            ("train.seq_len", t.seq_len), ("train.eval_batches", t.eval_batches),
        )
        for key, val in at_least_one:
            if val < 1:
                raise ConfigError(f"{src}: '{key}' must be ≥ 1, got {val}")
        # 0 means "automatic" (or "none") for these, so only negatives are wrong.
        at_least_zero = (
            ("model.ffn_dim", m.ffn_dim), ("parallel.dp", p.dp), ("parallel.microbatches", p.microbatches),
            ("train.steps", t.steps), ("train.stop_at", t.stop_at), ("train.warmup_steps", t.warmup_steps),
            ("train.eval_every", t.eval_every), ("launch.nproc_per_node", self.launch.nproc_per_node),
            ("launch.etcd_compact_interval", self.launch.etcd_compact_interval),
        )
        for key, val in at_least_zero:
            if val < 0:
                raise ConfigError(f"{src}: '{key}' must be ≥ 0 (0 = automatic or off), got {val}")
        # The GPT's rates and factors: nothing negative, betas and the held-out share below 1.
        check_bounds(m, "model", above={"rope_theta": 0, "norm_eps": 0, "init_std": 0})
        check_bounds(t, "train", at_least={"lr": 0, "min_lr": 0, "weight_decay": 0, "beta1": 0, "beta2": 0,
                                           "grad_clip": 0, "peak_tflops": 0, "log_every": 1},
                     below={"beta1": 1, "beta2": 1})
        check_bounds(self.data, "data", above={"val_fraction": 0}, below={"val_fraction": 1},
                     at_least={"max_bytes": 0})

    def validate_layout(self, world_size: int) -> None:
        """Raise :class:`ConfigError` for combinations that cannot run."""
        m, p, t, src = self.model, self.parallel, self.train, self.source
        self._validate_counts()
        if world_size < 1:
            raise ConfigError(
                f"{src}: world size {world_size} must be ≥ 1; run at least one process "
                f"(--world-size / --nproc-per-node / 'launch.nproc_per_node')"
            )
        if world_size % (p.pp * p.tp):
            raise ConfigError(
                f"{src}: world size {world_size} is not divisible by pp×tp = {p.pp}×{p.tp}; "
                f"run a multiple of {p.pp * p.tp} processes or change 'parallel.pp'/'parallel.tp'"
            )
        dp = p.dp or world_size // (p.pp * p.tp)
        if p.pp * dp * p.tp != world_size:
            raise ConfigError(
                f"{src}: pp×dp×tp = {p.pp}×{dp}×{p.tp} = {p.pp * dp * p.tp} does not match the "
                f"world size {world_size}; set 'parallel.dp = {world_size // (p.pp * p.tp)}' "
                f"or 'parallel.dp = 0' (automatic)"
            )
        stages = p.pp * p.stages_per_rank
        if m.n_layers % stages:
            raise ConfigError(
                f"{src}: 'model.n_layers' = {m.n_layers} cannot be split into {stages} pipeline "
                f"stages (pp={p.pp} × stages_per_rank={p.stages_per_rank}); use a multiple of {stages}"
            )
        if m.dim % m.n_heads:
            raise ConfigError(f"{src}: 'model.dim' = {m.dim} is not divisible by 'model.n_heads' = {m.n_heads}")
        if m.head_dim % 2:
            raise ConfigError(f"{src}: head dim {m.head_dim} (dim/n_heads) must be even for rotary embeddings")
        for key, val in (("model.n_heads", m.n_heads), ("model.vocab_size", m.vocab_size), ("ffn dim", m.hidden_dim)):
            if val % p.tp:
                raise ConfigError(
                    f"{src}: '{key}' = {val} is not divisible by 'parallel.tp' = {p.tp}; "
                    f"tensor parallelism splits it evenly across tp ranks"
                )
        if t.seq_len > m.max_seq_len:
            raise ConfigError(f"{src}: 'train.seq_len' = {t.seq_len} exceeds 'model.max_seq_len' = {m.max_seq_len}")
        if t.global_batch % dp:
            raise ConfigError(
                f"{src}: 'train.global_batch' = {t.global_batch} is not divisible by dp = {dp}; "
                f"the global batch is fixed and split evenly across data-parallel ranks"
            )
        local = t.global_batch // dp
        if local % p.n_microbatches:
            raise ConfigError(
                f"{src}: the per-replica batch {local} (global_batch/dp) is not divisible by "
                f"{p.n_microbatches} micro-batches; change 'parallel.microbatches' or 'train.global_batch'"
            )
        if p.pp > 1 and p.n_microbatches < p.pp:
            raise ConfigError(
                f"{src}: {p.n_microbatches} micro-batches cannot fill {p.pp} pipeline stages; "
                f"set 'parallel.microbatches' ≥ {p.pp}"
            )
        if p.pp_schedule == "zero-bubble" and dp > 1:
            raise ConfigError(
                f"{src}: pp_schedule 'zero-bubble' with FSDP2 (dp={dp}) computes silently wrong "
                f"gradients in torch 2.13; use '1f1b' or 'interleaved-1f1b', or dp = 1"
            )
        multi = p.pp_schedule in MULTI_STAGE_SCHEDULES
        if p.pp > 1 and multi and p.stages_per_rank < 2:
            raise ConfigError(f"{src}: pp_schedule '{p.pp_schedule}' needs 'parallel.stages_per_rank' ≥ 2")
        if not multi and p.stages_per_rank > 1:
            raise ConfigError(
                f"{src}: 'parallel.stages_per_rank' > 1 needs pp_schedule "
                f"{' or '.join(map(repr, MULTI_STAGE_SCHEDULES))}"
            )


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML run config, apply ``--set`` overrides, return a typed Config."""
    return config_from_dict(*read_config_table(path, overrides, "config file", "; see configs/ for examples"))


def config_from_dict(table: dict, source: str = "<dict>") -> Config:
    cfg = load_section(Config, table, "", source)
    cfg.source = source
    return cfg


def explain_all() -> str:
    return "\n".join(explain(Config))


def replace(cfg: Config, **sections: Any) -> Config:
    """A copy of ``cfg`` with some sections replaced (tests use this)."""
    return dataclasses.replace(cfg, **sections)
