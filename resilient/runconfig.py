"""The runtime's own knobs: ``[snapshot]``, ``[sdc]`` and ``[launch]``.

These are the sections every job has, whatever it trains: the built-in GPT's
run config (:mod:`resilient.gpt.config`) holds them next to its model and data
sections, and a user's script launched with ``resilient launch SCRIPT`` takes
them from ``--config FILE.toml`` (holding only these sections) and ``--set``.
The launcher resolves them once and hands them to the workers as JSON
(``RESILIENT_RUNTIME_CONFIG``); :mod:`resilient.job` reads them back.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from resilient.contract import RUNTIME_CONFIG_ENV  # where the launcher tells a worker its resolved config (JSON)
from resilient.configbase import check_bounds, knob, load_section, read_toml, section_to_dict
from resilient.errors import ConfigError
from resilient.failslow.api import FailSlowConfig
from resilient.sdc.api import SdcConfig
from resilient.snapshot.config import SnapshotConfig

__all__ = ["RuntimeConfig", "SnapshotConfig", "SdcConfig", "LaunchConfig", "load_runtime_config",
           "runtime_config_from_dict", "runtime_config_from_env", "apply_overrides", "read_config_table", "RUNTIME_SECTIONS", "is_runtime_config",
           "RUNTIME_CONFIG_ENV"]

# The sections a runtime config may hold; any other (model, train, ...) belongs to a
# trainer's own config.
RUNTIME_SECTIONS = ("snapshot", "sdc", "launch", "failslow")


@dataclass
class LaunchConfig:
    """How ``resilient launch`` runs the job: processes, nodes, supervision.

    Durations are in seconds here; the agent turns them into timedeltas."""

    nproc_per_node: int = knob(0, "worker processes on this node; 0 = the whole layout on one node (pp·dp·tp, with dp = 1 when automatic)")
    nnodes: str = knob("1", "nodes in the job: N, or MIN:MAX for an elastic job that shrinks and grows between them", coerce=(int,))
    max_restarts: int = knob(100, "worker-group failures tolerated before the job fails (a lost node does not count)")
    spares: int = knob(-1, "warm worker processes (torch imported, waiting) kept ready to replace failed ones; -1 = nproc_per_node, 0 = cold restarts")
    monitor_interval: float = knob(0.1, "seconds between checks of the workers' exit codes and heartbeats")
    heartbeat_timeout: float = knob(30.0, "a worker silent this long after its first step, or 4x its longest recent gap between steps when that is longer (checked SDC steps, evals, a loaded host), is hung (SIGSTOP, deadlock) and is killed")
    startup_timeout: float = knob(300.0, "a worker gets this long from start to its first heartbeat (imports, model build, restore)")
    node_lease_ttl: float = knob(3.0, "a node whose etcd liveness lease is not refreshed for this long is suspect; it is lost once a second signal confirms it (its agent's pid gone from this host, or its port refusing) or after max(60 s, 10 x this) without one")
    last_call_timeout: float = knob(1.0, "with MIN:MAX nodes, how long a round waits for more nodes once MIN are in (torch's default is 30)")
    keep_alive_interval: float = knob(1.0, "rendezvous keep-alive period; a node missing 3 of them is dropped from the round")
    join_timeout: float = knob(600.0, "how long a node waits for a rendezvous round to complete")
    join_progress_interval: float = knob(30.0, "while a node waits for a rendezvous round, it says this often which nodes are registered, how many the job needs and the etcd endpoint")
    rendezvous: str = knob("keys", "the rendezvous protocol: torch (torch's handler, one state key changed by compare-and-swap: fine up to ~32 nodes) or keys (a key per node: re-forms in about a second at hundreds of nodes; bench/scale.py)", choices=("torch", "keys"))
    preemption_grace: float = knob(20.0, "after SIGTERM, how long workers get to finish the step and save before SIGKILL")
    etcd_outage: float = knob(300.0, "seconds etcd may stay unreachable while the workers train on (the local tier keeps their snapshots); past it a node stops after its workers saved their newest step, and a relaunch resumes from the newest durable version")
    etcd_members: int = knob(1, "members of the embedded etcd (no --rdzv-endpoint): 3 or 5 = the agents that join the first one's grow it into a cluster of this many, one member per agent, so that from the third agent on losing any one node (its etcd member and data included) leaves the job training; 1 = the first agent's etcd alone (losing that agent ends the job; the default until the cluster has had its soak); 1, 3 or 5", choices=(1, 3, 5))
    etcd_compact_interval: float = knob(300.0, "seconds between compactions of etcd's history by each agent (a job that snapshots every step writes etcd records every step, ~0.5 GB of etcd database a day on the demo, and a full etcd refuses every write); 0 = never, for an etcd whose operators compact it")
    # On by default: an exporter switched on only after an incident has nothing to show about
    # it, and one costs an idle thread and a socket (the log is read only when scraped). A free
    # port by default, since several agents share a machine; the `metrics` event and the node
    # registry in etcd tell where. It exposes counts and timings, no secret: -1 where no port
    # may be opened.
    # Loopback by default: the numbers (node, run id, step, failures, auth failures) are the
    # operator's, not the network's, and a Prometheus on the machine scrapes loopback. A fleet's
    # scraper on another machine needs "0.0.0.0" or the interface facing it. Local users reach
    # loopback too: the page holds no secret and no training data.
    metrics_host: str = knob("127.0.0.1", "Prometheus metrics: the address /metrics is served on; 127.0.0.1 = this machine only (the default: the page names the node, run id, step, failure and auth-failure counts), 0.0.0.0 = every interface (a scraper on another machine)")
    metrics_port: int | str = knob(0, "Prometheus metrics of this agent (resilient.agent.metrics): the HTTP port to serve /metrics on, 0 = a free one (its address is the run's `metrics` event), -1 or \"off\" = no metrics")

    def __post_init__(self) -> None:
        # A wait or period of 0 (or below) would spin or declare everything lost at once; the
        # counts and the grace may be 0 (0 = automatic / none), spares -1 (= nproc_per_node).
        check_bounds(self, "launch",
                     at_least={"nproc_per_node": 0, "max_restarts": 0, "spares": -1, "last_call_timeout": 0,
                               "preemption_grace": 0, "etcd_compact_interval": 0},
                     above={"monitor_interval": 0, "heartbeat_timeout": 0, "startup_timeout": 0,
                            "node_lease_ttl": 0, "keep_alive_interval": 0, "join_timeout": 0, "join_progress_interval": 0,
                            "etcd_outage": 0})
        port = self.metrics_port
        if isinstance(port, str) and port.strip().lower() == "off":
            port = -1
        elif isinstance(port, str):
            try:
                port = int(port)
            except ValueError:
                port = None
        if isinstance(port, bool) or not isinstance(port, int) or not -1 <= port <= 65535:
            raise ConfigError(f"'launch.metrics_port' = {self.metrics_port!r}: expected a port 1-65535, "
                              "0 for a free one, or -1 (or \"off\") for no metrics")
        self.metrics_port = port


@dataclass
class RuntimeConfig:
    """The runtime sections alone: what ``resilient launch SCRIPT --config`` reads."""

    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sdc: SdcConfig = field(default_factory=SdcConfig)
    failslow: FailSlowConfig = field(default_factory=FailSlowConfig)
    source: str = field(default="<defaults>", compare=False, metadata={"internal": True})

    def to_dict(self) -> dict:
        d = section_to_dict(self)
        d.pop("source")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=100")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: a string
    return key.strip().split("."), value


def apply_overrides(table: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=v`` overrides to a raw TOML table (before validation)."""
    for item in overrides or []:
        path, value = _parse_override(item)
        node = table
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is not a table")
        node[path[-1]] = value
    return table


def runtime_config_from_dict(table: dict, source: str = "<dict>") -> RuntimeConfig:
    """A :class:`RuntimeConfig` from a table; a section that belongs to a trainer's config
    (``[model]``, ``[train]``, ...) is a :class:`ConfigError` that says where it goes."""
    other = sorted(k for k in table if k not in RUNTIME_SECTIONS)
    if other:
        raise ConfigError(
            f"{source}: [{'], ['.join(other)}] is not a runtime section; a runtime config (--config with a "
            f"script) holds only [{'], ['.join(RUNTIME_SECTIONS)}]. A built-in GPT run config is launched "
            "on its own: resilient launch CONFIG.toml")
    cfg = load_section(RuntimeConfig, table, "", source)
    cfg.failslow.validate(f"{source}: [failslow]")
    cfg.source = source
    return cfg


def read_config_table(path: str | os.PathLike | None, overrides: list[str] | None, what: str,
                      missing_hint: str = "") -> tuple[dict, str]:
    """(the TOML table of ``path`` with ``--set`` overrides applied, its source name); None:
    the defaults. ``what`` names the file in errors ("runtime config", "config file")."""
    source = str(path) if path else "<defaults>"
    table: dict = {}
    if path:
        try:
            table = read_toml(path, what)
        except FileNotFoundError:
            raise ConfigError(f"{what} {source} does not exist{missing_hint}") from None
    apply_overrides(table, overrides or [])
    return table, source


def is_runtime_config(path: str | os.PathLike | None, overrides: list[str]) -> bool:
    """Whether ``path`` holds only runtime sections and no ``--set`` names another: a script's
    runtime config, not a trainer's run config (``[model]``, ``[train]``, ...). No path, or a
    missing file, is not one: the trainer's loader has the defaults and says what to do."""
    if path is None:
        return False
    try:
        table = read_toml(path, "config file")
    except FileNotFoundError:
        return False
    other_keys = [o for o in overrides if o.partition(".")[0].strip() not in RUNTIME_SECTIONS]
    return bool(table) and set(table) <= set(RUNTIME_SECTIONS) and not other_keys


def load_runtime_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RuntimeConfig:
    """Read a runtime config (TOML; None = defaults), apply ``--set`` overrides."""
    return runtime_config_from_dict(*read_config_table(path, overrides, "runtime config"))


def runtime_config_from_env() -> RuntimeConfig | None:
    """The runtime config the launcher resolved for this worker, or None outside
    ``resilient launch`` (env :data:`RUNTIME_CONFIG_ENV` unset)."""
    path = os.environ.get(RUNTIME_CONFIG_ENV)
    if not path:
        return None
    with open(path) as f:
        return runtime_config_from_dict(json.load(f), source=path)
