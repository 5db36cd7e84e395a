"""``resilient launch CONFIG``: run a training job.

Resolves the config (file + ``--set`` overrides), validates the layout against
the number of processes before anything starts, writes the resolved config to
``RUN_DIR/config.json`` (what the workers read, and a record of the run), and
hands the workers to torch's elastic launcher, which supervises them and kills
them all on Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import uuid
from pathlib import Path

from resilient.config import Config, load_config
from resilient.errors import LaunchError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("config", help="run config (TOML), e.g. configs/demo.toml")
    ap.add_argument("--run-dir", default=None, help="where events, config and checkpoints go (default: runs/<config name>)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.steps=100 (repeatable)")
    ap.add_argument("--nproc-per-node", type=int, default=None, help="worker processes on this node (default: from the config)")
    ap.add_argument("--node-id", default=None, help="this node's name (default: hostname); lets several agents share a machine")


def worker_env(cfg: Config, nproc: int) -> dict[str, str]:
    """Environment for the workers: one intra-op thread per core they share,
    and a gloo/TCP store per attempt (torch 2.13's shared store hands
    restarted workers the previous attempt's addresses)."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return env


def prepare_run(args: argparse.Namespace) -> tuple[Config, Path, int]:
    cfg = load_config(args.config, args.overrides)
    nproc = args.nproc_per_node or cfg.default_world_size()
    cfg.validate_layout(nproc)
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return cfg, run_dir, nproc


def launch(args: argparse.Namespace) -> int:
    cfg, run_dir, nproc = prepare_run(args)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    node = args.node_id or socket.gethostname()
    os.environ.update(worker_env(cfg, nproc))
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"resilient-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"is_host": True},
        max_restarts=cfg.launch.max_restarts, monitor_interval=cfg.launch.monitor_interval,
        start_method="spawn",
    )
    print(f"resilient: {nproc} workers, layout {cfg.layout(nproc)} (pp, dp, tp), "
          f"{cfg.model.num_params() / 1e6:.2f}M parameters, run dir {run_dir}", file=sys.stderr)
    argv = ["-m", "resilient.worker", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir), "--node", node]
    try:
        elastic_launch(lc, entrypoint=sys.executable)(*argv)
    except ChildFailedError as e:
        raise LaunchError(f"training failed after {cfg.launch.max_restarts} restarts: {e.get_first_failure()[1].message}; "
                          f"see {run_dir / 'events.jsonl'}") from None
    return 0
