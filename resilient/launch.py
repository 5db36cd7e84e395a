"""``resilient launch CONFIG``: run this node's part of a training job.

One call per node. It resolves the config (file + ``--set`` overrides),
validates the layout for every world size the job may take (``--nnodes
MIN:MAX`` × processes per node) before anything starts, writes the resolved
config to ``RUN_DIR/config.json`` (what the workers read), finds etcd, and
runs a :class:`~resilient.agent.agent.ResilientAgent` until the job ends.

etcd: ``--rdzv-endpoint HOST:PORT[,...]`` uses an existing cluster (a real
fleet: three or five members, so no node is a single point of failure).
Without it, the first agent on a machine starts an embedded etcd and writes
its endpoint to ``RUN_DIR/etcd.endpoint``; other agents given the same run
dir join through that file. The embedded etcd lives in the first agent's
process tree: losing that node ends the job for everyone (see the README).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from resilient.config import Config, load_config
from resilient.errors import ConfigError, LaunchError


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("config", help="run config (TOML), e.g. configs/demo.toml")
    ap.add_argument("--run-dir", default=None, help="where events, config and checkpoints go (default: runs/<config name>)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.steps=100 (repeatable)")
    ap.add_argument("--nproc-per-node", type=int, default=None, help="worker processes on this node (default: from the config)")
    ap.add_argument("--nnodes", default=None, help="N or MIN:MAX nodes (default: launch.nnodes from the config)")
    ap.add_argument("--node-id", default=None, help="this node's name (default: hostname); lets several agents share a machine")
    ap.add_argument("--domain", default="", help="failure domain of this node (rack, zone): peer replicas go elsewhere")
    ap.add_argument("--rdzv-endpoint", default=None, help="etcd HOST:PORT[,HOST:PORT...]; default: an embedded etcd")
    ap.add_argument("--rdzv-conf", default="", help="extra rendezvous settings k=v,k=v (TLS, username, timeouts)")
    ap.add_argument("--run-id", default=None, help="job id shared by all nodes (default: derived from the run dir)")


def worker_env(nproc: int) -> dict[str, str]:
    """Environment every worker process starts with: :data:`~resilient.agent.warm.BASE_WORKER_ENV`
    and one intra-op thread per core the node's workers share."""
    from resilient.agent.warm import BASE_WORKER_ENV

    env = dict(BASE_WORKER_ENV)
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    return env


# Node and run ids name files (the node store under /dev/shm, temp dirs) and etcd keys:
# a "/" or ".." in one would reach outside the store, and a store is removed with rmtree.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(flag: str, value: str) -> str:
    """``value`` if it is a safe node/run id, else a :class:`ConfigError` naming ``flag``."""
    if not _NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{flag} {value!r} is not a valid name: use letters, digits, '.', '_' and '-' "
                          "(at most 128, starting with a letter or digit, no '..')")
    return value


def prepare_run(args: argparse.Namespace) -> tuple[Config, Path, Path, int, tuple[int, int]]:
    """(config, run dir, the config file this node's workers read, nproc, (min, max) nodes)."""
    from resilient.agent.api import parse_nnodes

    for flag, value in (("--node-id", args.node_id), ("--run-id", args.run_id)):
        if value is not None:
            check_name(flag, value)
    cfg = load_config(args.config, args.overrides)
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be ≥ 1, got {args.nproc_per_node}")
    nproc = args.nproc_per_node or cfg.default_world_size()
    nnodes = parse_nnodes(args.nnodes or cfg.launch.nnodes)
    bad = []
    for n in range(nnodes[0], nnodes[1] + 1):
        try:
            cfg.validate_layout(n * nproc)
        except ConfigError as e:
            bad.append(f"{n} node(s) × {nproc} = {n * nproc} processes: {e}")
    if bad:
        raise ConfigError("the layout does not fit every world size this job may take:\n  " + "\n  ".join(bad))
    from resilient.data import check_corpus  # imports torch: after the quick checks

    check_corpus(cfg.data.path, cfg.data.source)  # before etcd and workers start, not in each worker
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return cfg, run_dir, write_config(cfg, run_dir), nproc, nnodes
    except OSError as e:
        raise LaunchError(f"cannot use run dir {run_dir}: {e.strerror or e}; pass --run-dir with a writable "
                          "directory (it holds the events, the config and the checkpoints)") from e


def write_config(cfg: Config, run_dir: Path) -> Path:
    """Write the resolved config for this node's workers; returns its path.

    Why content-addressed (``config-<hash>.json``) and written by rename: nodes of a
    job share the run dir here (and on a shared filesystem), and a node's config may
    differ in node-local fields (its store address). One ``config.json`` rewritten by
    every agent at start let a node's workers read another node's config, or half of
    one. ``config.json`` is still written (atomically), for people and tools."""
    doc = json.dumps(cfg.to_dict(), indent=1)
    path = run_dir / f"config-{hashlib.sha256(doc.encode()).hexdigest()[:16]}.json"
    for target in (path, run_dir / "config.json"):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(doc)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temp file
    return path


def refuse_other_jobs(registry, cfg: Config, ttl: timedelta) -> None:
    """Raise :class:`ConfigError` when a live node of this run launched another job config.

    Nodes that disagree on the model, layout, schedule, data or SDC checks would train
    different things in one job: a crash at best (shapes), silently wrong at worst (an
    lr). A node that just died may still be listed until its lease lapses, so a
    mismatch is re-checked once after ``ttl`` before refusing (a quick restart of the
    whole job with a new config must not be refused)."""
    mine = cfg.job_digest()
    for attempt in range(2):
        nodes = registry.alive() or {}
        other = {n: d.get("job") for n, d in nodes.items()
                 if n != registry.node_id and d.get("job") not in (None, mine)}
        if not other:
            return
        if attempt == 0:
            time.sleep(ttl.total_seconds() + 0.5)
    raise ConfigError(
        f"node(s) {sorted(other)} of this run were launched with another config (job digest "
        f"{sorted(set(other.values()))}, this node {mine}): every node of a job must agree on "
        "[model], [parallel], [train], [data] and [sdc]. Launch this node with the same config "
        "file and --set overrides as the others, or give it another --run-id.")


@contextlib.contextmanager
def etcd_endpoint(args: argparse.Namespace, run_dir: Path) -> Iterator[str]:
    """The etcd to rendezvous through: given, shared through the run dir, or our own."""
    from resilient.etcd import EmbeddedEtcd, EtcdClient, EtcdError

    if args.rdzv_endpoint:
        yield args.rdzv_endpoint
        return
    shared = run_dir / "etcd.endpoint"
    if shared.exists():
        endpoint = shared.read_text().strip()
        try:
            with EtcdClient(endpoint, retry_timeout=timedelta(seconds=1)) as c:
                c.check(timedelta(seconds=2))
            yield endpoint
            return
        except EtcdError:
            pass  # a stale file from an ended run: start our own
    with EmbeddedEtcd() as etcd:
        shared.write_text(etcd.endpoint)
        print(f"resilient: embedded etcd at {etcd.endpoint} (other nodes: --rdzv-endpoint {etcd.endpoint} "
              f"or the same --run-dir)", file=sys.stderr)
        try:
            yield etcd.endpoint
        finally:
            with contextlib.suppress(FileNotFoundError):
                if shared.read_text().strip() == etcd.endpoint:
                    shared.unlink()


def default_run_id(run_dir: Path) -> str:
    """The job id agents derive when --run-id is not given: the same run dir
    (resolved path) gives the same id on every node."""
    return "run-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


def _rdzv_conf(text: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise LaunchError(f"--rdzv-conf {item!r}: expected key=value")
        conf[key.strip()] = value.strip()
    return conf


# The --rdzv-conf keys that say how to reach etcd (TLS, auth, timeouts): workers need them too.
_ETCD_KEYS = {"protocol", "ca_cert", "cacert", "ssl_cert", "cert", "ssl_cert_key", "key", "username", "user",
              "request_timeout", "retry_timeout"}


def worker_etcd_conf(conf: dict[str, str]) -> dict[str, str]:
    """What workers need of the agent's ``--rdzv-conf`` to reach etcd. A password given there
    goes to the workers through the environment they inherit, never into their arguments."""
    if conf.get("password"):
        from resilient.rendezvous.registry import PASSWORD_ENV

        os.environ[PASSWORD_ENV] = conf["password"]
    return {k: v for k, v in conf.items() if k in _ETCD_KEYS}


def store_settings(cfg: Config):
    """The node store's settings, or None when the memory tiers are off."""
    from resilient.agent.store import StoreSettings

    snap = cfg.snapshot
    if snap.every <= 0 or not snap.memory:
        return None
    return StoreSettings(base=snap.store_dir, replicas=snap.replicas, keep=snap.store_keep,
                         rate_bytes_s=snap.replicate_mib_s * (1 << 20), host=snap.store_host,
                         duty=snap.replicate_duty, max_stride=snap.replicate_max_stride)


def _raise_on_signal(signum, frame):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"received {signal.Signals(signum).name}", sigval=signal.Signals(signum))


def launch(args: argparse.Namespace) -> int:
    cfg, run_dir, config_path, nproc, nnodes = prepare_run(args)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # From here a signal at any point (etcd starting, the job check's wait, the agent's
    # run) unwinds every context (etcd stopped, lease revoked) and exits 128 + signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_on_signal)
    try:
        return _run_node(args, cfg, run_dir, config_path, nproc, nnodes)
    except SignalException as e:
        return 128 + int(e.sigval)


def _run_node(args: argparse.Namespace, cfg: Config, run_dir: Path, config_path: Path, nproc: int,
              nnodes: tuple[int, int]) -> int:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from resilient.agent.agent import ResilientAgent
    from resilient.agent.api import AgentSettings
    from resilient.agent.membership import NodeRegistry
    from resilient.agent.quarantine import Quarantine
    from resilient.events import EventLog
    from resilient.rendezvous import client_from_params, register

    lc = cfg.launch
    min_nodes, max_nodes = nnodes
    node = args.node_id or socket.gethostname()
    run_id = args.run_id or default_run_id(run_dir)
    events = EventLog(run_dir / "events.jsonl", node=node, rank=-1)
    env = worker_env(nproc)
    os.environ.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_WORKER_IDENTICAL": "1"})
    print(f"resilient: node {node}, {nproc} workers, {min_nodes}:{max_nodes} nodes, "
          f"{cfg.model.num_params() / 1e6:.2f}M parameters, run dir {run_dir}", file=sys.stderr)

    with etcd_endpoint(args, run_dir) as endpoint:
        register()
        conf = {"last_call_timeout": lc.last_call_timeout, "keep_alive_interval": lc.keep_alive_interval,
                "keep_alive_max_attempt": 3, "join_timeout": lc.join_timeout, **_rdzv_conf(args.rdzv_conf)}
        params = RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id=run_id,
                                      min_nodes=min_nodes, max_nodes=max_nodes, **conf)
        handler = rendezvous_handler_registry.create_handler(params)
        client = client_from_params(params)
        settings = AgentSettings(
            node_id=node, run_dir=str(run_dir), min_nodes=min_nodes, max_nodes=max_nodes,
            nproc_per_node=nproc, spares=nproc if lc.spares < 0 else lc.spares,
            max_restarts=lc.max_restarts, domain=args.domain,
            monitor_interval=timedelta(seconds=lc.monitor_interval),
            heartbeat_timeout=timedelta(seconds=lc.heartbeat_timeout),
            startup_timeout=timedelta(seconds=lc.startup_timeout),
            lease_ttl=timedelta(seconds=lc.node_lease_ttl),
            preemption_grace=timedelta(seconds=lc.preemption_grace),
            etcd_compact_interval=timedelta(seconds=lc.etcd_compact_interval),
            run_id=run_id, etcd_endpoint=endpoint,
            etcd_factory=lambda: client_from_params(params),
            etcd_conf=worker_etcd_conf(_rdzv_conf(args.rdzv_conf)),
            store=store_settings(cfg),
            worker_argv=["--config", str(config_path), "--run-dir", str(run_dir), "--node", node],
            worker_env=env,
        )
        spec = WorkerSpec(role="trainer", local_world_size=nproc, rdzv_handler=handler,
                          entrypoint=sys.executable, args=(), max_restarts=lc.max_restarts,
                          monitor_interval=lc.monitor_interval)
        try:
            registry = NodeRegistry(client, run_id, node, args.domain, timedelta(seconds=lc.node_lease_ttl))
            Quarantine(client, run_id).refuse_if_quarantined(node, endpoint)
            registry.claim(job=cfg.job_digest())
            try:
                refuse_other_jobs(registry, cfg, timedelta(seconds=lc.node_lease_ttl))
                agent = ResilientAgent(spec, settings, registry, events)
            except BaseException:
                registry.leave()  # our claim must not hold the node id for a lease ttl
                raise
            events.emit("agent_start", run_id=run_id, endpoint=endpoint, nnodes=[min_nodes, max_nodes], nproc=nproc)
            result = agent.run()
        finally:
            client.close()
        if result is None:  # the rendezvous was closed: the job ended elsewhere
            return 0
        if agent.quarantined:
            raise LaunchError(f"node {node!r} was quarantined: one of its devices computed wrong answers "
                              f"(see the sdc_* events in {run_dir / 'events.jsonl'}); the other nodes go on without it")
        if result.is_failed():
            raise LaunchError(f"training failed: {agent.give_up_reason(result)}; see {run_dir / 'events.jsonl'}")
        handler.shutdown()
    return 0

