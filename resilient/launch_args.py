"""The command line of ``resilient launch``: both forms, torchrun's option names.

    resilient launch [OPTIONS] SCRIPT [ARGS...]      a user's script
    resilient launch [OPTIONS] -m MODULE [ARGS...]   a user's module, as python -m
    resilient launch CONFIG.toml [OPTIONS]           the built-in GPT

Everything after SCRIPT (or -m MODULE) goes to the script untouched, as under
torchrun; a ``.toml`` in its place is the GPT's run config, whose options may
follow it. Errors are :class:`LaunchUsageError` (exit code 2 through
:mod:`resilient.cli`), raised before anything starts. Imports nothing heavy:
the launcher parses its command line before it imports torch.
"""

from __future__ import annotations

import argparse

from resilient.errors import LaunchError


class LaunchUsageError(LaunchError):
    """The command line of ``resilient launch`` is wrong: an unknown option, no script."""


USAGE = """resilient launch [OPTIONS] SCRIPT [ARGS...]
       resilient launch [OPTIONS] -m MODULE [ARGS...]
       resilient launch CONFIG.toml [OPTIONS]"""

DESCRIPTION = """Run this node's part of a training job under the resilient agent: warm
restarts, node snapshots in RAM, peer replicas, heartbeats, preemption.

Your own script, as under torchrun (workers get RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...); everything after
SCRIPT (or -m MODULE) goes to the script untouched:

  resilient launch --nproc-per-node 2 train.py --steps 100
  resilient launch --nnodes 1:4 --rdzv-endpoint etcd:2379 --rdzv-id job7 -m mypkg.train --lr 3e-4
  resilient launch --config runtime.toml --set snapshot.every=10 train.py

The built-in GPT, from its run config (options may follow it):

  resilient launch configs/demo.toml --set train.steps=100"""

EPILOG = """--config takes a runtime config: a TOML holding only [snapshot], [sdc] and
[launch] (see `resilient config --explain`); --max-restarts, --nproc-per-node
and --nnodes override its [launch] knobs. A GPT run config (with [model],
[train], ...) is launched on its own, not through --config."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors typed (exit code 2 and one line, through resilient.cli)."""

    hint = "see resilient launch --help"

    def error(self, message: str):
        raise LaunchUsageError(f"{message} ({self.hint})")


def _parser() -> _Parser:
    return _Parser(prog="resilient launch", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)


# --rdzv-conf keys that are one setting with the [launch] knob of the same name (torchrun's users
# pass them in --rdzv-conf): a key given sets the knob, so the agent (its waits and what they say)
# and the rendezvous use one value, range-checked as the knob is. The rendezvous' table of keys
# (resilient.rendezvous.registry.RDZV_CONF, which imports torch: not read here) marks the same ones.
RDZV_CONF_KNOBS = ("join_timeout", "last_call_timeout", "keep_alive_interval")


def rdzv_conf_knobs(text: str) -> dict[str, float]:
    """The [launch] knobs a ``--rdzv-conf`` value sets (:data:`RDZV_CONF_KNOBS`), in seconds.
    Malformed items are left to the rendezvous' own parse, which names them."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip() in RDZV_CONF_KNOBS:
            try:
                out[key.strip()] = float(value)
            except ValueError:
                raise LaunchUsageError(f"--rdzv-conf {key.strip()}={value.strip()!r}: expected seconds (a number); "
                                       f"it sets launch.{key.strip()}") from None
    return out


def _common_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of both forms; torchrun's names (and their underscore spellings) where
    they mean the same thing."""
    ap.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None, metavar="N",
                    help="worker processes on this node: a number, or gpu, cpu, auto as torchrun "
                         "(default: [launch] nproc_per_node; a GPT config: its layout; a script: 1)")
    ap.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                    help="N or MIN:MAX nodes, an elastic job between them (default: [launch] nnodes)")
    ap.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=None, metavar="N",
                    help="worker-group failures tolerated before the job fails (default: [launch] max_restarts)")
    ap.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None,
                    metavar="HOST:PORT[,...]", help="etcd endpoints; default: an embedded etcd")
    ap.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default="", metavar="K=V,...",
                    help="extra rendezvous settings k=v,k=v (TLS, username, timeouts)")
    ap.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", default=None,
                    help="job id shared by all nodes (default: derived from the run dir)")
    ap.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None, metavar="N",
                    help="accepted as torchrun does; ignored: the rendezvous orders the nodes")
    ap.add_argument("--standalone", action="store_true",
                    help="a one-node job with its own embedded etcd (never one shared through the run dir)")
    ap.add_argument("--node-id", default=None,
                    help="this node's name (default: hostname); lets several agents share a machine")
    ap.add_argument("--domain", default="", help="failure domain of this node (rack, zone): peer replicas go elsewhere")
    ap.add_argument("--run-dir", default=None,
                    help="where events, configs and checkpoints go (default: runs/<script or config name>)")
    ap.add_argument("--secret-file", default=None, metavar="PATH",
                    help="the job secret (a file of mode 0600, the same on every node; default: "
                         "$RESILIENT_JOB_SECRET_FILE, $RESILIENT_JOB_SECRET, else RUN_DIR/job.secret, created)")
    ap.add_argument("--metrics-port", dest="metrics_port", default=None, metavar="PORT|off",
                    help="serve this agent's Prometheus metrics on PORT (0: a free one, named in the run's "
                         "`metrics` event; off: none) (default: [launch] metrics_port, 0)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set snapshot.every=10 (repeatable)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The GPT form: ``CONFIG.toml`` and the common options, in any order."""
    ap.add_argument("config", help="the built-in GPT's run config (TOML), e.g. configs/demo.toml")
    _common_arguments(ap)


def _script_parser(positionals: bool = True) -> _Parser:
    ap = _parser()
    _common_arguments(ap)
    ap.add_argument("--config", dest="runtime_config", default=None, metavar="RUNTIME.toml",
                    help="the runtime's knobs for a script: a TOML with only [snapshot], [sdc], [launch]")
    ap.add_argument("-m", "--module", action="store_true",
                    help="run MODULE as python -m does, instead of a SCRIPT path")
    if positionals:
        ap.add_argument("target", nargs="?", metavar="SCRIPT | MODULE | CONFIG.toml")
        ap.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    return ap


def _target_index(argv: list[str], target: str) -> int:
    """Where SCRIPT/MODULE stands in ``argv``: the first place holding it that options alone
    lead up to. What follows goes to the script as given (argparse would drop a ``--``)."""
    options = _script_parser(positionals=False)
    for i, arg in enumerate(argv):
        if arg != target:
            continue
        try:
            _, extra = options.parse_known_args(argv[:i])
        except LaunchUsageError:
            continue
        if extra in ([], ["--"]):
            return i
    raise LaunchUsageError(f"cannot tell where {target!r} stands in the command line")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Either form; ``form`` is "script" or "gpt". Errors are :class:`LaunchUsageError`."""
    args = _script_parser().parse_args(argv)
    if args.target is None:
        if args.module:
            raise LaunchUsageError("-m needs a module: resilient launch [OPTIONS] -m MODULE [ARGS...]")
        raise LaunchUsageError("nothing to run: name a script (resilient launch [OPTIONS] SCRIPT [ARGS...]), "
                               "a module (-m MODULE) or a GPT run config (resilient launch CONFIG.toml)")
    if not args.module and args.target.lower().endswith(".toml"):
        if args.runtime_config is not None:
            raise LaunchUsageError(
                f"{args.target} is a TOML file where the script goes. A runtime config goes after --config, "
                f"followed by the script: resilient launch --config {args.runtime_config} SCRIPT [ARGS...]; "
                "a GPT run config is launched on its own: resilient launch CONFIG.toml")
        gpt = _parser()
        gpt.hint = (f"{args.target} is launched as the built-in GPT's run config, which takes launch options only; "
                    "to run a script, name it: resilient launch [OPTIONS] SCRIPT [ARGS...]")
        add_arguments(gpt)
        args = gpt.parse_args(argv)
        args.form = "gpt"
        return args
    args.script_args = argv[_target_index(argv, args.target) + 1:]
    args.form = "script"
    return args
