"""The ``resilient`` command: a thin dispatcher to the subcommands.

    resilient launch [OPTIONS] SCRIPT [ARGS...] | -m MODULE [ARGS...]
    resilient launch CONFIG [--run-dir DIR] [--set k=v ...]
    resilient config [CONFIG] [--explain] [--set k=v ...]
    resilient ckpt ls|inspect|verify|reshard|convert|import|diff|gc ...
    resilient chaos run SCENARIO [--out DIR] | report DIR
    resilient doctor [CONFIG] [--rdzv-endpoint HOST:PORT] [--run-dir DIR]
    resilient status RUN_DIR | --rdzv-endpoint HOST:PORT --run-id ID [--once] [--json]
    resilient store ls|drop [RUN_ID] [--node N] [--store-dir DIR]

Each subcommand's code lives in its own module; this file only parses the
first word and maps typed errors to a one-line message and exit code 2. The program
installed to run run configs (:class:`resilient.launch.ProgramPlugin`: the built-in GPT)
reads them for ``config`` and ``doctor`` and adds its own commands (the GPT's
``resilient data prepare SRC OUT``).
"""

from __future__ import annotations

import argparse
import json
import sys

from resilient.errors import ResilientError


def _cmd_launch(argv: list[str]) -> int:
    from resilient import launch  # light: parses before anything imports torch
    from resilient.agent import warm

    args = launch.parse_args(argv)
    # Every config error (a typo, a negative interval) is answered here, before anything imports
    # torch, even in the zygote: a wrong knob costs the user no torch import (minutes on a loaded host).
    # A run config is run by the program installed for it (launch.config_program: the built-in GPT).
    run = launch.prepare_run(args)
    if warm.wants_zygote(argv):
        # its torch import overlaps ours (see warm.start_early)
        warm.start_early(run.program.preload)
    try:
        return launch.launch(args, run=run)
    finally:
        early = warm.take_early()  # not adopted: the launch failed before its agent started
        if early is not None:
            from resilient.agent.pool import discard_early

            discard_early(early)


def _cmd_config(argv: list[str]) -> int:
    from resilient.launch import config_program

    plugin = config_program()   # the program that reads run configs (the built-in GPT), if installed
    ap = argparse.ArgumentParser(prog="resilient config", description="Show a resolved config, or every knob.")
    ap.add_argument("config", nargs="?", help="run config (TOML)")
    ap.add_argument("--explain", action="store_true", help="list every knob with its default and documentation, then the --rdzv-conf keys and the "
                    "environment variables")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--world-size", type=int, default=None, help="also validate the layout for this many processes")
    args = ap.parse_args(argv)
    if args.explain:
        from resilient.contract import explain_environment
        from resilient.rendezvous.registry import explain_rdzv_conf

        print(plugin.explain() if plugin else runtime_knobs())
        print("\n# --rdzv-conf keys (resilient launch and torchrun --rdzv-backend etcd3): key = default  # meaning")
        print("\n".join(explain_rdzv_conf()))
        print("\n# environment variables the runtime reads")
        print("\n".join(explain_environment()))
        return 0
    print(json.dumps(_resolve(plugin, args.config, args.overrides, args.world_size), indent=1))
    return 0


def runtime_knobs() -> str:
    """Every knob of a runtime config ([snapshot], [launch], [sdc], [failslow]), a line each."""
    from resilient.configbase import explain
    from resilient.runconfig import RuntimeConfig

    return "\n".join(explain(RuntimeConfig))


def _resolve(plugin, path: str | None, overrides: list[str], world_size: int | None) -> dict:
    """A runtime config as resolved, or a program's run config (its layout checked)."""
    from resilient.runconfig import is_runtime_config, load_runtime_config

    if is_runtime_config(path, overrides):
        return load_runtime_config(path, overrides).to_dict()
    if plugin is None:
        from resilient.launch import no_program

        raise no_program(path or "resilient config")
    return plugin.resolve(path, overrides, world_size)


def _cmd_ckpt(argv: list[str]) -> int:
    from resilient_tools.cli import main as ckpt_main

    return ckpt_main(argv)


def _cmd_chaos(argv: list[str]) -> int:
    from resilient_chaos.runner import main as chaos_main

    return chaos_main(argv)


def _cmd_doctor(argv: list[str]) -> int:
    from resilient.commands.doctor import main as doctor_main
    from resilient.launch import config_program

    plugin = config_program()   # a run config's program, handed down (the runtime never imports the trainer)
    return doctor_main(argv, plugin.preflight if plugin else None)


def _cmd_status(argv: list[str]) -> int:
    from resilient.commands.status import main as status_main

    return status_main(argv)


def _cmd_store(argv: list[str]) -> int:
    from resilient.commands.store import main as store_main

    return store_main(argv)


def _cmd_quarantine(argv: list[str]) -> int:
    from resilient.commands.quarantine import main as quarantine_main

    return quarantine_main(argv)


COMMANDS = {
    "launch": (_cmd_launch, "run a training job"),
    "ckpt": (_cmd_ckpt, "inspect, verify, reshard, convert, diff and gc checkpoints"),
    "chaos": (_cmd_chaos, "run a fault-injection campaign, or report on one"),
    "status": (_cmd_status, "a live view of a job: members, round, commits, failures, recoveries, goodput"),
    "quarantine": (_cmd_quarantine, "list or clear nodes quarantined for silent data corruption or marked slow"),
    "store": (_cmd_store, "list or drop the node stores (RAM) that stopped agents kept on this machine"),
    "config": (_cmd_config, "show or explain a run config"),
    "doctor": (_cmd_doctor, "check this node (shm, open files, etcd, clock, disk, GPUs) before launching"),
}


def _commands() -> dict:
    """The built-in commands, then those of the installed program (``resilient data``: the GPT's);
    a program's command never shadows a built-in one."""
    from resilient.launch import config_program

    plugin = config_program()
    added = {name: (c.run, c.doc) for name, c in (plugin.commands if plugin else {}).items() if name not in COMMANDS}
    return {**COMMANDS, **added}


def _usage(commands: dict) -> str:
    lines = ["usage: resilient COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in commands.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(_usage(_commands()))
            return 0 if argv else 2
        if argv[0] == "--version":
            from resilient import __version__

            print(__version__)
            return 0
        # The installed program's commands are looked up only for a word that is not built in:
        # `resilient launch` pays no entry-point scan.
        cmd = COMMANDS.get(argv[0])
        if cmd is None:
            commands = _commands()
            cmd = commands.get(argv[0])
            if cmd is None:
                print(f"resilient: unknown command {argv[0]!r}\n\n{_usage(commands)}", file=sys.stderr)
                return 2
        return cmd[0](argv[1:])
    except ResilientError as e:
        print(f"resilient {argv[0] if argv else ''}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"resilient {argv[0] if argv else ''}: interrupted", file=sys.stderr)
        return 130


def console() -> int:
    """The ``resilient`` command and ``python -m resilient.cli``: :func:`main`; a launch then
    ends without the interpreter's teardown of torch (:func:`resilient.procs.exit_without_teardown`).
    Tests call :func:`main` in their own process."""
    code = main()
    if sys.argv[1:2] == ["launch"]:
        from resilient.procs import exit_without_teardown

        exit_without_teardown(code)
    return code


if __name__ == "__main__":
    sys.exit(console())
