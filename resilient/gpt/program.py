"""How ``resilient launch CONFIG.toml`` runs the built-in GPT: its :class:`~resilient.launch.Program`.

Everything the launcher knows of the trainer is here: the config is read and its layout
validated for every world size the job may take (``--nnodes MIN:MAX`` × processes per
node), the corpus checked, before anything starts; the workers run
:mod:`resilient.gpt.worker` with the resolved config as JSON. :data:`GPT` (its
:class:`~resilient.launch.ProgramPlugin`: this program, its config for ``resilient config``
and ``doctor``, and its ``resilient data`` command) is registered under the entry-point group
``resilient.programs`` (pyproject.toml), where :func:`resilient.launch.config_program` finds
it: the runtime never names or imports the trainer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from resilient.errors import ConfigError
from resilient.launch import Command, Program, ProgramPlugin, node_counts, write_content_addressed

if TYPE_CHECKING:
    from resilient.gpt.config import Config
    from resilient.runconfig import RuntimeConfig

GPT_ENTRY = "resilient.gpt.worker"
GPT_PRELOAD = ("torch.distributed.fsdp", "torch._dynamo",   # fully_shard's first call imports dynamo (resilient.launch)
               "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
               "resilient.gpt.train", "resilient.gpt.worker",
               "resilient.sdc.native:library")  # the SDC kernels: built once per machine, loaded once for every fork


def gpt_program(args: argparse.Namespace) -> Program:
    """The built-in GPT from ``CONFIG.toml`` and ``--set``: its layout validated for every world
    size the job may take (``--nnodes MIN:MAX`` x processes per node) and its corpus checked,
    before anything starts."""
    from resilient.configbase import read_toml
    from resilient.gpt.config import load_config
    from resilient.runconfig import RuntimeConfig, is_runtime_config

    if is_runtime_config(args.config, args.overrides):
        raise ConfigError(
            f"{args.config} holds only [{'], ['.join(sorted(read_toml(args.config, 'config file')))}]: a runtime "
            f"config, not a GPT run config (which has [model], [train], [data], ...). To run a script with it: "
            f"resilient launch --config {args.config} SCRIPT [ARGS...]")
    cfg = load_config(args.config, args.overrides)
    nproc, nnodes = node_counts(args, cfg.launch, cfg.default_world_size())
    bad = []
    for n in range(nnodes[0], nnodes[1] + 1):
        try:
            cfg.validate_layout(n * nproc)
        except ConfigError as e:
            bad.append(f"{n} node(s) × {nproc} = {n * nproc} processes: {e}")
    if bad:
        raise ConfigError("the layout does not fit every world size this job may take:\n  " + "\n  ".join(bad))
    from resilient.gpt.data import check_corpus  # imports torch: after the quick checks

    check_corpus(cfg.data.path, cfg.data.source)  # before etcd and workers start, not in each worker

    def argv(run_dir: Path, node: str) -> list[str]:
        return ["--config", str(write_config(cfg, run_dir)), "--run-dir", str(run_dir), "--node", node]

    return Program(entry=GPT_ENTRY, preload=GPT_PRELOAD,
                   runtime=RuntimeConfig(snapshot=cfg.snapshot, launch=cfg.launch, sdc=cfg.sdc, failslow=cfg.failslow,
                                         source=cfg.source),
                   job_digest=cfg.job_digest(), nproc=cfg.default_world_size(),
                   describe=f"{cfg.model.num_params() / 1e6:.2f}M parameters", name=Path(args.config).stem,
                   heartbeats=True, argv=argv, params=cfg.model.num_params(), device=cfg.train.device)


def write_config(cfg: Config, run_dir: Path) -> Path:
    """Write the GPT's resolved config for this node's workers; returns its path (see
    :func:`write_content_addressed`). ``config.json`` is also written, for people and tools."""
    return write_content_addressed(run_dir, "config", json.dumps(cfg.to_dict(), indent=1))




def resolve(path: str | None, overrides: list[str], world_size: int | None) -> dict:
    """``resilient config``: the run config as resolved, its layout checked for ``world_size``
    processes (default: the config's own)."""
    from resilient.gpt.config import load_config

    cfg = load_config(path, overrides)
    cfg.validate_layout(world_size or cfg.default_world_size())
    return cfg.to_dict()


def explain() -> str:
    """``resilient config --explain``: every knob of a run config."""
    from resilient.gpt.config import explain_all

    return explain_all()


def preflight(path: str | None, overrides: list[str]) -> tuple[RuntimeConfig, int, str]:
    """``resilient doctor CONFIG``: the config's runtime sections, the model's parameters, its device."""
    from resilient.gpt.config import load_config

    cfg = load_config(path, overrides)
    return cfg, cfg.model.num_params(), cfg.train.device


def prepare_data(argv: list[str]) -> int:
    """``resilient data prepare SRC OUT [--max-bytes N]``."""
    import sys

    if not argv or argv[0] != "prepare":
        print("usage: resilient data prepare SRC OUT [--max-bytes N]", file=sys.stderr)
        return 2
    from resilient.gpt.data import main_prepare

    return main_prepare(argv[1:])


GPT = ProgramPlugin(program=gpt_program, resolve=resolve, explain=explain, preflight=preflight,
                    commands={"data": Command(prepare_data, "prepare a token corpus")})
