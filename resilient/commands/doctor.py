"""``resilient doctor [CONFIG]``: the launcher's preflight checks alone, as a table.

Why a command of its own: on a new machine, container or cluster node, what is wrong
(a 64 MB /dev/shm, a low open-files limit, an etcd out of reach or of the wrong
version, a clock off, a full disk, missing GPUs) is best found before a job is
submitted, and all at once: ``resilient launch`` stops at the first failed check
with nothing started, doctor lists every check with what to do. Exit code 2 when a
check fails, as launch would refuse to start.

CONFIG is a GPT run config (``configs/demo.toml``) or a script's runtime config
(only ``[snapshot]``, ``[sdc]``, ``[launch]``); without one only the node itself is
checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from resilient.preflight import plan_for, run_checks


def _load(path: str | None, overrides: list[str], load_gpt_config: Callable[[str, list[str]], Any]):
    """(the runtime sections, the model's parameters or None, the device) of ``path``."""
    from resilient.configbase import read_toml
    from resilient.runconfig import RUNTIME_SECTIONS, load_runtime_config

    if path is None:
        return None, None, "auto"
    try:
        table = read_toml(path, "config file")
    except FileNotFoundError:
        table = {"model": {}}  # let the GPT loader find a shipped config or say what to do
    gpt_keys = [o for o in overrides if o.partition(".")[0].strip() not in RUNTIME_SECTIONS]
    if table and set(table) <= set(RUNTIME_SECTIONS) and not gpt_keys:
        return load_runtime_config(path, overrides), None, "auto"
    cfg = load_gpt_config(path, overrides)
    return cfg, cfg.model.num_params(), cfg.train.device


def main(argv: list[str], load_gpt_config: Callable[[str, list[str]], Any]) -> int:
    """``load_gpt_config``: the built-in GPT's config loader, handed over by the command line
    (the runtime does not import the trainer; see tests/unit/project/test_layers.py)."""
    from resilient.agent.api import parse_nnodes

    ap = argparse.ArgumentParser(prog="resilient doctor", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="run config (TOML); without it only the node itself is checked")
    ap.add_argument("--run-dir", default=None, help="the run dir the job will use (default: runs/<config name>)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--nproc-per-node", type=int, default=None, help="workers on this node (default: the config's)")
    ap.add_argument("--nnodes", default=None, help="N or MIN:MAX (default: the config's launch.nnodes)")
    ap.add_argument("--rdzv-endpoint", default=None, help="etcd HOST:PORT[,...] the job will use; default: the embedded etcd")
    ap.add_argument("--rdzv-conf", default="", help="TLS settings as for launch (protocol=, ca_cert=, cert=, key=)")
    args = ap.parse_args(argv)
    runtime, params, device = _load(args.config, args.overrides, load_gpt_config)
    default_nproc = getattr(runtime, "default_world_size", lambda: 1)() if runtime is not None else 1
    nproc = args.nproc_per_node or (runtime.launch.nproc_per_node if runtime is not None else 0) or default_nproc
    nnodes = parse_nnodes(args.nnodes or (runtime.launch.nnodes if runtime is not None else "1"))
    run_dir = Path(args.run_dir or Path("runs") / (Path(args.config).stem if args.config else "doctor"))
    plan = plan_for(runtime, run_dir, nproc, nnodes, args.rdzv_endpoint, args.rdzv_conf, params=params, device=device)
    report = run_checks(plan)
    print(report.table())
    if report.failed:
        print(f"\n{len(report.failed)} check(s) failed: `resilient launch` would refuse to start", file=sys.stderr)
        return 2
    return 0
