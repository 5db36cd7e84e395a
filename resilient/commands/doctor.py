"""``resilient doctor [CONFIG]``: the launcher's preflight checks alone, as a table.

Why a command of its own: on a new machine, container or cluster node, what is wrong
(a 64 MB /dev/shm, a low open-files limit, an etcd out of reach or of the wrong
version, a clock off, a full disk, missing GPUs) is best found before a job is
submitted, and all at once: ``resilient launch`` stops at the first failed check
with nothing started, doctor lists every check with what to do. Exit code 2 when a
check fails, as launch would refuse to start.

CONFIG is a GPT run config (``configs/demo.toml``: read by the program installed for run
configs, :class:`resilient.launch.ProgramPlugin`) or a script's runtime config (only
``[snapshot]``, ``[sdc]``, ``[launch]``, ``[failslow]``); without one only the node itself
is checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from resilient.preflight import plan_for, run_checks

# A run config's program reads it: (path, overrides) -> (its runtime sections, the model's
# parameters or None, the device) (resilient.launch.ProgramPlugin.preflight).
Preflight = Callable[[str, list[str]], tuple[Any, "int | None", str]]


def _load(path: str | None, overrides: list[str], preflight: Preflight | None):
    """(the runtime sections, the model's parameters or None, the device) of ``path``."""
    from resilient.runconfig import is_runtime_config, load_runtime_config

    if path is None:
        return None, None, "auto"
    if is_runtime_config(path, overrides):
        return load_runtime_config(path, overrides), None, "auto"
    if preflight is None:
        from resilient.launch import no_program

        raise no_program(path)
    return preflight(path, overrides)


def main(argv: list[str], preflight: Preflight | None = None) -> int:
    """``preflight``: how the installed program reads a run config, handed over by the command
    line (the runtime does not import the trainer; see tests/unit/project/test_layers.py)."""
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
    runtime, params, device = _load(args.config, args.overrides, preflight)
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
