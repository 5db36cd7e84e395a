"""``resilient launch``: run this node's part of a training job.

Two forms, one per node, like ``torchrun``::

    resilient launch [OPTIONS] SCRIPT [ARGS...]      a user's script (or -m MODULE)
    resilient launch CONFIG.toml [OPTIONS]           the built-in GPT

The form decides the :class:`Program`, what the workers run: the script under
:mod:`resilient.agent.script` (:func:`script_program`), or, for a run config, the program
installed under the entry-point group ``resilient.programs`` (:func:`config_program`, a
:class:`ProgramPlugin`: the built-in GPT registers ``resilient.gpt.program:GPT`` there, with
its ``resilient data`` command; the runtime never names or imports the trainer, and a trainer
of your own plugs in the same way). Everything else
is shared: every check runs before anything starts; the runtime config
(``[snapshot]``, ``[sdc]``, ``[launch]``) is written to the run dir as JSON
for the workers (``RESILIENT_RUNTIME_CONFIG``); then etcd is found and a
:class:`~resilient.agent.agent.ResilientAgent` runs until the job ends.

etcd: ``--rdzv-endpoint HOST:PORT[,...]`` uses an existing cluster (a real
fleet: three or five members, so no node is a single point of failure).
Without it, the agents of a run dir share an embedded etcd: the one whose
claim on ``RUN_DIR/control`` wins runs it, the others join it, in any start
order (:mod:`resilient.control`). The embedded etcd lives in its owner's
process tree: losing that node ends the job for everyone (see docs/elastic.md).

This module imports no torch at import time: ``resilient launch`` parses its
command line and starts its warm zygote before the heavy imports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from resilient.contract import SCRIPT_ENTRY, check_name, default_run_id, events_path
from resilient.errors import ConfigError, LaunchError, ResilientError
from resilient.launch_args import LaunchUsageError, add_arguments, parse_args, rdzv_conf_knobs  # noqa: F401  (the command line)
from resilient.rundir import RunDirUnsafe, local_path, private_dir, write_private

if TYPE_CHECKING:
    from resilient.runconfig import LaunchConfig, RuntimeConfig
    from resilient.snapshot.config import SnapshotConfig


@dataclass
class Program:
    """What this node's workers run: all that differs between the built-in GPT and a
    user's script. The rest (etcd, rendezvous, agent, environment) is the same."""

    entry: str                      # module whose main(argv) runs one worker (resilient.agent.warm)
    preload: tuple[str, ...]        # imported once by the warm zygote: "module" or "module:function"
    runtime: RuntimeConfig          # [snapshot], [sdc], [launch]: to the workers as RESILIENT_RUNTIME_CONFIG
    job_digest: str                 # what every node of the job must agree on (refuse_other_jobs)
    nproc: int                      # workers per node when --nproc-per-node is not given
    describe: str                   # one line for the banner
    name: str                       # the default run dir is runs/<name>
    heartbeats: bool                # beats from its first step (AgentSettings.worker_heartbeats)
    argv: Callable[[Path, str], list[str]]  # (run dir, node id) -> the workers' argv; may write what they read
    params: int | None = None       # the model's parameters, when the program knows (preflight: the store's size)
    device: str = "auto"            # what the workers train on: cpu, cuda, auto (preflight: the devices)


def _digest(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


# -- a user's script ----------------------------------------------------------------------

# What torchrun scripts import on their way to the first step (DDP, FSDP2), and our runner.
# torch._dynamo: FSDP2's fully_shard imports it on first use (torch._compile's disable
# wrapper), 1.2-1.4 s of a warm restart's 3.7 s on this CPU (cProfile of fully_shard on a
# 7 M-parameter model), paid in every forked worker unless the zygote imports it once.
SCRIPT_PRELOAD = ("torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp", "torch._dynamo", SCRIPT_ENTRY)


def script_preload() -> tuple[str, ...]:
    """:data:`SCRIPT_PRELOAD`, and the public job API where this install has it."""
    import importlib.util

    return SCRIPT_PRELOAD + (("resilient.job",) if importlib.util.find_spec("resilient.job") else ())


def script_program(args: argparse.Namespace) -> Program:
    """A user's script (or ``-m`` module) and its runtime config (``--config``, ``--set``)."""
    from resilient.runconfig import load_runtime_config

    if args.runtime_config is not None and Path(args.runtime_config).suffix == ".py":
        raise ConfigError(
            f"--config {args.runtime_config} is a Python file: --config takes a runtime config (TOML with "
            f"[snapshot], [sdc], [launch]); the script goes last: resilient launch [--config RUNTIME.toml] "
            f"{args.runtime_config} [ARGS...]")
    runtime = load_runtime_config(args.runtime_config, args.overrides)
    if args.module:
        check_module(args.target)
    else:
        check_script(args.target)
    argv = (["-m"] if args.module else []) + [args.target, *args.script_args]
    what = "module" if args.module else "script"
    return Program(entry=SCRIPT_ENTRY, preload=script_preload(), runtime=runtime,
                   job_digest=_digest({what: args.target, "args": args.script_args, "sdc": runtime.to_dict()["sdc"]}),
                   nproc=runtime.launch.nproc_per_node or 1, describe=f"{what} {shlex.join([args.target, *args.script_args])}",
                   name=args.target.rpartition(".")[2] if args.module else Path(args.target).stem,
                   heartbeats=False, argv=lambda run_dir, node: argv)


def check_script(path: str) -> None:
    """A :class:`ConfigError` unless ``path`` is a script Python can run; a syntax error is
    found here, not by every worker after the rendezvous."""
    import zipfile

    p = Path(path)
    usage = "resilient launch [OPTIONS] SCRIPT [ARGS...]"
    if not p.exists():
        raise ConfigError(f"script {path} does not exist (looked from {os.getcwd()}); pass the path of "
                          f"your training script: {usage}")
    if p.is_dir():
        if not (p / "__main__.py").is_file():
            raise ConfigError(f"script {path} is a directory without a __main__.py; pass the script: {usage}")
        return
    if zipfile.is_zipfile(p):
        return  # a zip application, as python runs it
    try:
        source = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read script {path}: {e.strerror or e}; check its permissions") from None
    not_a_script = ConfigError(f"{path} is a TOML file, not a Python script: a GPT run config is launched as "
                               "resilient launch CONFIG.toml (named *.toml), a runtime config goes after --config")
    if p.suffix != ".py" and _is_toml(source):  # "[model]\ndim = 8" even compiles as Python
        raise not_a_script
    try:
        compile(source, str(p), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        if _is_toml(source):
            raise not_a_script from None
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        raise ConfigError(f"script {path} is not valid Python: {getattr(e, 'msg', e)}{where}") from None


def _is_toml(source: bytes) -> bool:
    """A non-empty TOML document (what a config, not a script, is)."""
    import tomllib

    try:
        return bool(tomllib.loads(source.decode()))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def check_module(name: str) -> None:
    """A :class:`ConfigError` unless ``-m name`` can be found as ``python -m`` finds it (the
    current directory first). Only the top-level package is looked up: finding a submodule
    would import (run) its package here."""
    import importlib.util

    if name.endswith(".py") or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"-m {name!r} is not a module name (a script's path goes without -m): "
                          "resilient launch [OPTIONS] -m MODULE [ARGS...]")
    top = name.partition(".")[0]
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(top) is not None
    finally:
        sys.path.remove(cwd)
    if not found:
        raise ConfigError(f"-m {name}: no module named {top!r} in {cwd} or the installed packages")


# -- shared by both forms -----------------------------------------------------------------

def _nproc(value: str | None) -> int | None:
    """``--nproc-per-node``: a number, or torchrun's gpu / cpu / auto."""
    if value is None:
        return None
    if value in ("gpu", "cpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if value == "gpu" and not gpus:
            raise ConfigError("--nproc-per-node gpu: this machine has no CUDA device; pass a number or cpu")
        return gpus if value == "gpu" or (value == "auto" and gpus) else (os.cpu_count() or 1)
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--nproc-per-node {value!r}: expected a number, or gpu, cpu, auto") from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node must be ≥ 1, got {n}")
    return n


def node_counts(args: argparse.Namespace, launch_cfg: LaunchConfig, default_nproc: int) -> tuple[int, tuple[int, int]]:
    """(workers on this node, (min, max) nodes): the flags over the ``[launch]`` knobs."""
    from resilient.agent.api import parse_nnodes

    if args.standalone and (args.rdzv_endpoint or args.nnodes not in (None, "1", "1:1")):
        raise LaunchUsageError("--standalone is a one-node job with its own etcd: drop --rdzv-endpoint and --nnodes")
    nnodes = (1, 1) if args.standalone else parse_nnodes(args.nnodes or launch_cfg.nnodes)
    return _nproc(args.nproc_per_node) or default_nproc, nnodes


def worker_env(nproc: int) -> dict[str, str]:
    """Environment every worker process starts with: :data:`~resilient.agent.warm.BASE_WORKER_ENV`
    and one intra-op thread per core the node's workers share."""
    from resilient.agent.warm import BASE_WORKER_ENV

    env = dict(BASE_WORKER_ENV)
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    return env


@dataclass
class Run:
    """One node's launch, resolved: the program and where and how many."""

    program: Program
    run_dir: Path
    node: str
    nproc: int
    nnodes: tuple[int, int]
    max_restarts: int
    worker_argv: list[str]
    runtime_config: Path            # the RuntimeConfig JSON the workers read


ProgramFactory = Callable[[argparse.Namespace], Program]


@dataclass(frozen=True)
class Command:
    """A subcommand a program adds to the ``resilient`` command line (the built-in GPT's
    ``resilient data``): ``run(argv) -> exit code``, typed errors printed by the dispatcher."""

    run: Callable[[list[str]], int]
    doc: str                        # one line for ``resilient --help``


@dataclass(frozen=True)
class ProgramPlugin:
    """All the command line knows of a program that runs run configs: the public plug-in
    interface a trainer registers under :data:`PROGRAMS`. The runtime never names the trainer;
    without one installed, ``resilient config`` and ``doctor`` handle runtime configs only."""

    program: ProgramFactory         # resilient launch CONFIG.toml
    # resilient config [CONFIG] [--set ...] [--world-size N]: (path, overrides, world size or None)
    # -> the resolved run config as JSON, its layout checked for that world size (else its default).
    resolve: Callable[[str | None, list[str], int | None], dict]
    explain: Callable[[], str]      # every knob of its run config, a line each: resilient config --explain
    # resilient doctor CONFIG: (path, overrides) -> (its runtime sections, the model's parameters
    # or None, the device it trains on: cpu, cuda, auto).
    preflight: Callable[[str | None, list[str]], tuple[Any, int | None, str]]
    commands: Mapping[str, Command] = dataclasses.field(default_factory=dict)


# The entry-point group of the programs that run a run config (``resilient launch CONFIG.toml``):
# ``NAME = "package.module:PLUGIN"``, a :class:`ProgramPlugin` (the built-in GPT's is
# resilient.gpt.program:GPT, registered in pyproject.toml).
PROGRAMS = "resilient.programs"


def config_program() -> ProgramPlugin | None:
    """The program installed to run a run config, or None when there is none. With several
    installed the choice would be a guess: a :class:`LaunchError` names them."""
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=PROGRAMS)}
    if len(found) > 1:
        raise LaunchError(f"several programs are installed to run a run config ({', '.join(sorted(found))}, "
                          f"entry-point group {PROGRAMS!r}): uninstall all but one, or launch a script instead")
    if not found:
        return None
    (name, ep), = found.items()
    plugin = ep.load()
    if not isinstance(plugin, ProgramPlugin):
        raise LaunchError(f"the program {name!r} installed under {PROGRAMS!r} ({ep.value}) is a "
                          f"{type(plugin).__name__}, not a resilient.launch.ProgramPlugin: reinstall it, or "
                          f"uninstall it (pip uninstall) and launch a script instead")
    return plugin


def no_program(what: str) -> LaunchError:
    """The error of a run config given where no program is installed to read it."""
    return LaunchError(f"{what}: no program is installed to run a run config with (entry-point group "
                       f"{PROGRAMS!r}; the built-in GPT registers itself there: a checkout whose install is "
                       f"older than its code needs `pip install -e .` again); or launch a script instead "
                       f"(resilient launch [OPTIONS] SCRIPT [ARGS...])")


def prepare_run(args: argparse.Namespace, program_factory: ProgramFactory | None = None) -> Run:
    """Every check, then the run dir and the files the workers read. Nothing starts here.

    ``program_factory``: what runs a run config (``resilient launch CONFIG.toml``); default: the
    program installed under :data:`PROGRAMS` (:func:`config_program`)."""
    for flag, value in (("--node-id", args.node_id), ("--run-id", args.run_id)):
        if value is not None:
            check_name(flag, value)
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be ≥ 0, got {args.max_restarts}")
    if args.form == "gpt":
        if program_factory is None:
            plugin = config_program()
            if plugin is None:
                raise no_program(args.config)
            program_factory = plugin.program
        program = program_factory(args)
    else:
        program = script_program(args)
    lc = program.runtime.launch
    nproc, nnodes = node_counts(args, lc, program.nproc)
    max_restarts = lc.max_restarts if args.max_restarts is None else args.max_restarts
    # What the workers read is what this node runs: the flags over the [launch] knobs (a copy:
    # the GPT's own config is written as it was resolved), and --rdzv-conf's keys that are knobs
    # too (launch_args.RDZV_CONF_KNOBS: one setting; the knob's range check applies).
    program.runtime = dataclasses.replace(program.runtime, launch=dataclasses.replace(
        lc, nproc_per_node=nproc, nnodes=f"{nnodes[0]}:{nnodes[1]}", max_restarts=max_restarts,
        metrics_port=lc.metrics_port if args.metrics_port is None else args.metrics_port,
        **rdzv_conf_knobs(args.rdzv_conf)))
    node = args.node_id or socket.gethostname()
    run_dir = Path(args.run_dir or Path("runs") / program.name).resolve()
    try:
        private_run_dir(run_dir, program.runtime.snapshot.durable_url)
        runtime_config = write_content_addressed(run_dir, "runtime", program.runtime.to_json())
        worker_argv = program.argv(run_dir, node)
    except RunDirUnsafe:
        raise
    except OSError as e:
        raise LaunchError(f"cannot use run dir {run_dir}: {e.strerror or e}; pass --run-dir with a writable "
                          "directory (it holds the events, the config and the checkpoints)") from e
    return Run(program, run_dir, node, nproc, nnodes, max_restarts, worker_argv, runtime_config)


def private_run_dir(run_dir: Path, durable_url: str) -> None:
    """The run dir, and the ``file://`` durable tier when it lies in it (by default
    ``RUN_DIR/checkpoints``), created or checked private (:mod:`resilient.rundir`)."""
    private_dir(run_dir)
    durable = local_path(durable_url) if durable_url else run_dir / "checkpoints"
    if durable is not None and durable.is_relative_to(run_dir) and durable != run_dir:
        private_dir(durable, "durable tier (snapshot.durable_url)", narrow=True)


def write_content_addressed(run_dir: Path, stem: str, doc: str) -> Path:
    """Write ``doc`` as ``RUN_DIR/<stem>-<hash>.json`` (what this node's workers read; its
    path is returned) and ``<stem>.json`` (the newest, for people and tools), each by rename.

    Why content-addressed: nodes of a job share the run dir here (and on a shared
    filesystem), and a node's config may differ in node-local fields (its store address).
    One file rewritten by every agent at start let a node's workers read another node's
    config, or half of one."""
    path = run_dir / f"{stem}-{hashlib.sha256(doc.encode()).hexdigest()[:16]}.json"
    for target in (path, run_dir / f"{stem}.json"):
        write_private(target, doc)   # 0600 whatever the umask: the configs are the job user's alone
    return path


def refuse_other_jobs(registry, digest: str, ttl: timedelta) -> None:
    """Raise :class:`ConfigError` when a live node of this run launched another job.

    Nodes that disagree on what they train (the GPT's model, layout, schedule, data; a
    script, its arguments) or on the SDC checks would train different things in one job:
    a crash at best (shapes), silently wrong at worst (an lr). A node that just died may
    still be listed until its lease lapses, so a mismatch is re-checked once after
    ``ttl`` before refusing (a quick restart of the whole job with a new config must not
    be refused)."""
    for attempt in range(2):
        nodes = registry.alive() or {}
        other = {n: d.get("job") for n, d in nodes.items()
                 if n != registry.node_id and d.get("job") not in (None, digest)}
        if not other:
            return
        if attempt == 0:
            time.sleep(ttl.total_seconds() + 0.5)
    raise ConfigError(
        f"node(s) {sorted(other)} of this run were launched with another job (job digest "
        f"{sorted(set(other.values()))}, this node {digest}): every node of a job must agree on what it "
        "trains and on [sdc]: the built-in GPT's [model], [parallel], [train] and [data]; a script, its "
        "arguments. Launch this node with the same command line, config file and --set overrides as the "
        "others, or give it another --run-id.")


# How long the owner of an embedded etcd keeps it up for the other agents of the run once
# its own agent is done: they leave within seconds of each other after a job ends (torch's
# exit barrier), and a node that died is out once its lease lapses (launch.node_lease_ttl).
LEAVE_WAIT = timedelta(seconds=15)


@contextlib.contextmanager
def etcd_endpoint(args: argparse.Namespace, run_dir: Path, run_id: str | None = None,
                  node: str | None = None, secret=None, members: int = 1) -> Iterator[str]:
    """The etcd to rendezvous through: given (``--rdzv-endpoint``, the operator's to secure),
    else the run dir's embedded etcd, owned by one of its agents (:mod:`resilient.control.plane`:
    claimed atomically, client TLS and a login derived from the job ``secret``, default the one
    in the environment); ``--standalone``: always our own, shared with nobody. The owner keeps
    its etcd up at the end until the other agents of ``run_id`` have left (at most
    :data:`LEAVE_WAIT`), so that their last calls (the lease revoke, the rendezvous close)
    succeed at once instead of retrying against a dead etcd."""
    if args.rdzv_endpoint:
        yield args.rdzv_endpoint
        return
    from resilient.control.plane import embedded_etcd
    from resilient.secret import require_secret

    secret = secret if secret is not None else require_secret(what="the embedded etcd")
    def let_the_others_leave(etcd) -> None:
        if run_id is not None:
            wait_for_agents_to_leave(etcd, run_id, node, LEAVE_WAIT)

    with embedded_etcd(run_dir, secret, standalone=args.standalone, before_stop=let_the_others_leave,
                       members=members, node=node or "") as endpoint:
        yield endpoint


def wait_for_agents_to_leave(etcd, run_id: str, node: str | None, bound: timedelta) -> list[str]:
    """Wait until no agent of ``run_id`` but ``node`` is registered (each revokes its lease
    as it leaves; a dead one's lapses), at most ``bound``; the ones still there."""
    from resilient.agent.membership import registry_prefix
    from resilient.etcd import EtcdError

    prefix = registry_prefix(run_id)
    deadline = time.monotonic() + bound.total_seconds()
    others: list[str] = []
    try:
        with etcd.client(retry_timeout=timedelta(seconds=1)) as c:
            while True:
                others = [kv.key.decode()[len(prefix):] for kv in c.get_prefix(prefix)]
                others = [n for n in others if n != node]
                if not others or time.monotonic() >= deadline:
                    return others
                time.sleep(0.2)
    except EtcdError:  # our etcd is gone: nobody can use it any more
        return others


def worker_etcd_conf(conf: dict[str, str]) -> dict[str, str]:
    """What workers need of the agent's ``--rdzv-conf`` to reach etcd. A password given there
    goes to the workers through the environment they inherit, never into their arguments."""
    from resilient.contract import PASSWORD_ENV
    from resilient.rendezvous.registry import client_keys

    if conf.get("password"):
        os.environ[PASSWORD_ENV] = conf["password"]
    return {k: v for k, v in conf.items() if k in client_keys() - {"password"}}


def store_settings(snap: SnapshotConfig):
    """The node store's settings from ``[snapshot]``, or None when the memory tiers are off."""
    from resilient.agent.store import StoreSettings

    if not snap.memory_on:
        return None
    # every = "auto": the workers' chooser keeps versions within the link budget, and their
    # steps need not be multiples of anything: the replicator takes every version (stride 1).
    return StoreSettings(base=snap.store_dir, replicas=snap.replicas, keep=snap.store_keep,
                         rate_bytes_s=snap.replicate_mib_s * (1 << 20), host=snap.store_host,
                         duty=snap.replicate_duty, commit=snap.commit,
                         max_stride=1 if "memory" in snap.auto_tiers else snap.replicate_max_stride)


def _raise_on_signal(signum, frame):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"received {signal.Signals(signum).name}", sigval=signal.Signals(signum))


def launch(args: argparse.Namespace, run: Run | None = None) -> int:
    """Run this node until the job ends; ``args`` from :func:`parse_args`, ``run`` from
    :func:`prepare_run` when the caller checked the config already."""
    run = run if run is not None else prepare_run(args)
    from resilient.preflight import check_before_launch  # a FAIL raises: etcd, store, workers not started

    check_before_launch(args, run)
    if args.node_rank is not None:
        print(f"resilient: --node-rank {args.node_rank} ignored: the rendezvous orders the nodes "
              "(as under torchrun with a dynamic rendezvous backend)", file=sys.stderr)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # From here a signal at any point (etcd starting, the job check's wait, the agent's
    # run) unwinds every context (etcd stopped, lease revoked) and exits 128 + signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_on_signal)
    try:
        return _run_node(args, run)
    except SignalException as e:
        return 128 + int(e.sigval)


def _run_node(args: argparse.Namespace, run: Run) -> int:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters, rendezvous_handler_registry

    from resilient.agent.agent import ResilientAgent
    from resilient.agent.api import AgentSettings
    from resilient.agent.membership import NodeRegistry
    from resilient.agent.quarantine import Quarantine
    from resilient.control.plane import AUTO_SYNC
    from resilient.etcd.server import embedded_etcd_conf
    from resilient.events import EventLog
    from resilient.ledger import run_copies
    from resilient.rendezvous import client_from_params, register
    from resilient.rendezvous.registry import parse_rdzv_conf
    from resilient.secret import provide_job_secret

    program, run_dir, node, nproc = run.program, run.run_dir, run.node, run.nproc
    lc = program.runtime.launch
    min_nodes, max_nodes = run.nnodes
    run_id = args.run_id or default_run_id(run_dir)
    events = EventLog(events_path(run_dir), node=node, rank=-1)
    # The quarantine's copies beside etcd's, where a relaunch finds them (resilient.ledger)
    ledger = run_copies(run_dir, program.runtime.snapshot.durable_url)
    os.environ.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_WORKER_IDENTICAL": "1"})
    # The job secret (given, or RUN_DIR/job.secret), named in the environment for the rendezvous,
    # registry, quarantine and node store of this process and for the workers: resilient.secret.
    secret = provide_job_secret(run_dir, getattr(args, "secret_file", None))
    print(f"resilient: node {node}, {nproc} workers, {min_nodes}:{max_nodes} nodes, "
          f"{program.describe}, run dir {run_dir}", file=sys.stderr)

    with etcd_endpoint(args, run_dir, run_id, node, secret, members=lc.etcd_members) as endpoint:
        register()
        # On our embedded etcd every client logs in with the job secret's password (etcd_endpoint).
        sync = AUTO_SYNC if lc.etcd_members > 1 else None   # one member: no others to follow
        rdzv_conf = {**parse_rdzv_conf(args.rdzv_conf),
                     **({} if args.rdzv_endpoint else embedded_etcd_conf(secret, auto_sync=sync))}
        # destroy_at_exit: our workers leave with os._exit, never through the exit it guards.
        conf = {"last_call_timeout": lc.last_call_timeout, "keep_alive_interval": lc.keep_alive_interval,
                "keep_alive_max_attempt": 3, "join_timeout": lc.join_timeout, "handler": lc.rendezvous,
                "destroy_at_exit": "false", **rdzv_conf}
        params = RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id=run_id,
                                      min_nodes=min_nodes, max_nodes=max_nodes, **conf)
        handler = rendezvous_handler_registry.create_handler(params)
        client = client_from_params(params)
        settings = AgentSettings(
            node_id=node, run_dir=str(run_dir), min_nodes=min_nodes, max_nodes=max_nodes,
            nproc_per_node=nproc, spares=nproc if lc.spares < 0 else lc.spares,
            max_restarts=run.max_restarts, domain=args.domain,
            monitor_interval=timedelta(seconds=lc.monitor_interval),
            heartbeat_timeout=timedelta(seconds=lc.heartbeat_timeout),
            startup_timeout=timedelta(seconds=lc.startup_timeout),
            lease_ttl=timedelta(seconds=lc.node_lease_ttl),
            preemption_grace=timedelta(seconds=lc.preemption_grace),
            etcd_compact_interval=timedelta(seconds=lc.etcd_compact_interval),
            etcd_outage=timedelta(seconds=lc.etcd_outage),
            join_timeout=timedelta(seconds=lc.join_timeout),
            join_progress_interval=timedelta(seconds=lc.join_progress_interval),
            run_id=run_id, etcd_endpoint=endpoint,
            etcd_factory=lambda: client_from_params(params),
            etcd_conf=worker_etcd_conf(rdzv_conf),
            store=store_settings(program.runtime.snapshot),
            worker_entry=program.entry, worker_argv=run.worker_argv, worker_preload=program.preload,
            worker_env=worker_env(nproc), worker_heartbeats=program.heartbeats,
            runtime_config=str(run.runtime_config), failslow=program.runtime.failslow,
            metrics_port=lc.metrics_port if lc.metrics_port >= 0 else None, metrics_host=lc.metrics_host,
            durable_url=program.runtime.snapshot.durable_url,
        )
        spec = WorkerSpec(role="trainer", local_world_size=nproc, rdzv_handler=handler,
                          entrypoint=sys.executable, args=(), max_restarts=run.max_restarts,
                          monitor_interval=lc.monitor_interval)
        agent, succeeded = None, False
        try:
            registry = NodeRegistry(client, run_id, node, args.domain, timedelta(seconds=lc.node_lease_ttl),
                                    confirm=loss_confirm_bound(lc.node_lease_ttl))
            quarantine = Quarantine(client, run_id, copies=ledger)
            quarantine.refuse_if_quarantined(node, clear_hint(args, run_dir, run_id))
            registry.claim(job=program.job_digest)
            try:
                refuse_other_jobs(registry, program.job_digest, timedelta(seconds=lc.node_lease_ttl))
                agent = ResilientAgent(spec, settings, registry, events)
            except BaseException:
                registry.leave()  # our claim must not hold the node id for a lease ttl
                raise
            events.emit("agent_start", run_id=run_id, endpoint=endpoint, nnodes=[min_nodes, max_nodes], nproc=nproc,
                        domain=args.domain or node)
            try:
                result = agent.run()
            except RendezvousError as e:
                if isinstance(e, ResilientError):   # ours: typed, and says what to do
                    raise
                raise LaunchError(rendezvous_failed_message(e, registry, node, min_nodes, lc.join_timeout,
                                                            run_dir)) from e
            succeeded = result is not None and not agent.quarantined and not result.is_failed()
            if agent.quarantined:
                others = nodes_left(registry, quarantine)
        finally:
            if agent is not None:
                agent.leave(close_rendezvous=succeeded)
            client.close()
        if result is None:  # the rendezvous was closed: the job ended elsewhere
            return 0
        if agent.quarantined:
            raise LaunchError(quarantined_message(node, others, min_nodes, run_dir, clear_hint(args, run_dir, run_id)))
        if result.is_failed():
            raise LaunchError(f"training failed: {agent.give_up_reason(result)}; see {events_path(run_dir)}")
    return 0


def loss_confirm_bound(lease_ttl: float) -> timedelta:
    """How long a node whose lease lapsed may stay missing, without a second signal that it is
    gone (its pid, its port), before it is declared lost: a loaded host stalls an agent for
    17-60 s (issue 38) and a real loss is confirmed at once by that signal on most machines."""
    return timedelta(seconds=max(60.0, 10 * lease_ttl))


def rendezvous_failed_message(error: BaseException, registry, node: str, min_nodes: int, join_timeout: float,
                              run_dir: Path) -> str:
    """torch's rendezvous error (a round that never completed: ``RendezvousTimeoutError``, a
    closed one) as what is missing and what to do: the nodes still there, the ones the job needs."""
    others = nodes_left(registry, None)
    there = "etcd cannot say which nodes are there" if others is None else (
        f"nodes registered now: {', '.join([node, *others])}")
    return (f"the rendezvous did not complete ({type(error).__name__}: {error}); the job needs at least {min_nodes} "
            f"node(s) within launch.join_timeout ({join_timeout:.0f} s), and {there}. Start the missing nodes (a node "
            f"that stopped says why in its output and in {events_path(run_dir)}: an `agent_stop` event), "
            "then relaunch this one")


def clear_hint(args: argparse.Namespace, run_dir: Path, run_id: str) -> str:
    """The options of ``resilient quarantine clear NODE`` that reach this run's records."""
    hint = f"--run-dir {shlex.quote(str(run_dir))}"
    if args.run_id:
        hint += f" --run-id {run_id}"
    if args.rdzv_endpoint:
        hint += f" --rdzv-endpoint {args.rdzv_endpoint}"
    return hint


def nodes_left(registry, quarantine) -> list[str] | None:
    """The live nodes of the run but this one and the quarantined (None: etcd cannot say)."""
    try:
        alive, out = registry.alive(), (quarantine.all() if quarantine is not None else set())
    except Exception:   # etcd gone: unknown, not none
        return None
    if alive is None:
        return None
    return sorted(n for n in alive if n != registry.node_id and n not in out)


def quarantined_message(node: str, others: list[str] | None, min_nodes: int, run_dir: Path, hint: str) -> str:
    """Why this node stopped, and what is next: the others go on, or, with fewer than the job's
    minimum left (the only node, say), the job cannot go on here until the node is cleared or replaced."""
    why = (f"node {node!r} was quarantined: one of its devices computed wrong answers (see the sdc_* events in "
           f"{events_path(run_dir)}), and it is refused until cleared")
    clear = f"`resilient quarantine clear {node} {hint}`"
    if others is not None and len(others) >= min_nodes:
        return (f"{why}; the other nodes ({', '.join(others)}) go on without it. After checking or replacing its "
                f"hardware: {clear}")
    left = "no node is left" if not others else f"{len(others)} node(s) are left ({', '.join(others)})"
    return (f"{why}. The job cannot go on here: {left}, fewer than its minimum of {min_nodes}. Check or replace "
            f"the device, then clear the node with {clear} and relaunch; or launch the job on healthy nodes "
            f"(another machine, or --node-id of a spare)")
