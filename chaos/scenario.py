"""Chaos scenarios as data: a TOML file → typed, validated dataclasses.

A scenario names the topology to launch, the training config to run, the
faults to inject (what, where, when) and the properties to check, plus a time
budget. Faults are data so that a campaign is reproducible from the file and
its seed alone: :meth:`Scenario.plan` turns the faults into a concrete,
deterministic list of :class:`PlannedFault` (random-rate faults are drawn from
``random.Random(seed)``), which the runner then executes.

Every table is loaded with :func:`resilient.configbase.load_section`, so a
misspelt key is rejected with the file, the key and the closest known key,
rather than silently ignored (a typo in a chaos file would otherwise turn a
fault off and let a campaign pass for the wrong reason).
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient.configbase import knob, load_section, read_toml
from resilient.errors import ConfigError

def _many(kind: type, doc: str) -> Any:
    """A documented list/dict knob; `knob` takes a plain default, which a
    dataclass refuses for mutable values."""
    return field(default_factory=kind, metadata={"doc": doc})


SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"

TIERS = ("local", "peer", "durable")


# --------------------------------------------------------------------------
# Per-kind fault parameters. Each kind has its own table so that a parameter
# that does not apply to a kind (say `grace_seconds` on a partition) is an
# error, not a silently ignored knob.
# --------------------------------------------------------------------------
@dataclass
class KillParams:
    """kill-worker / kill-node: SIGKILL, no chance to clean up."""

    remove_shm: bool = knob(True, "kill-node only: also delete the node's /dev/shm snapshot store (a lost node loses its RAM)")


@dataclass
class HangParams:
    """hang: SIGSTOP the target, SIGCONT after `seconds` (0 = never resume)."""

    seconds: float = knob(30.0, "how long the target stays stopped; 0 = until the run ends (the agent must detect and replace it)")
    tree: bool = knob(False, "stop the target's whole process tree, not just the process")


@dataclass
class PreemptParams:
    """preemption: SIGTERM, then SIGKILL after the grace period."""

    grace_seconds: float = knob(10.0, "time between SIGTERM and SIGKILL, as a cloud provider gives")


@dataclass
class NetParams:
    """partition / link-cut / packet-loss (network namespaces + iptables)."""

    seconds: float = knob(20.0, "how long the fault lasts before the rules are removed")
    probability: float = knob(0.0, "packet-loss only: probability that each packet is dropped, in (0, 1]")


@dataclass
class ProxyParams:
    """delay / bandwidth / reset through the TCP proxy in front of a service."""

    seconds: float = knob(20.0, "how long the degradation lasts")
    delay_ms: float = knob(0.0, "delay only: one-way delay added to every chunk, each direction")
    bytes_per_second: int = knob(0, "bandwidth only: cap on each direction of each connection")
    refuse_new: bool = knob(False, "reset only: also reset new connections while the fault lasts")


@dataclass
class EtcdLossParams:
    """etcd-loss: stop etcd members, restart them after `seconds`."""

    members: int = knob(1, "how many members to stop (a majority loses quorum)")
    seconds: float = knob(15.0, "how long the members stay down; 0 = never restarted")


@dataclass
class EtcdKillParams:
    """embedded-etcd-kill: kill -9 one etcd member; its watch must restart it (same ports, data)."""

    settle_seconds: float = knob(15.0, "how long the member's watch gets to have it serving again")


@dataclass
class StorageParams:
    """storage-flaky: object-store faults through the faulty fsspec wrapper."""

    mode: str = knob("errors", "what goes wrong", choices=("errors", "latency", "torn-write"))
    probability: float = knob(0.3, "share of storage operations affected")
    latency_ms: float = knob(0.0, "latency mode: added latency per operation")
    seconds: float = knob(30.0, "how long storage stays flaky")


@dataclass
class BitflipParams:
    """bitflip: flip one bit through the SDC hook. The keys are those of
    ``resilient.sdc.inject.FlipSpec`` (rank comes from the fault's target,
    step is the job's next step when the request arrives)."""

    target: str = knob("grad", "which tensor of the named parameter", choices=("grad", "param", "optim_state", "activation"))
    tensor: str = knob("", "parameter name as model.named_parameters() gives it (a module name for 'activation'); empty = the consumer's first parameter")
    bit: int = knob(30, "bit index in the element (fp32: 31 sign, 30-23 exponent, 22-0 mantissa)")
    element: int = knob(0, "index into the rank-local flattened tensor; negative counts from the end")
    persistent: bool = knob(False, "flip at every step from then on, replays included (a bad device), not once (a transient fault)")
    state_key: str = knob("exp_avg", "optimizer state entry for target = 'optim_state'")


@dataclass
class DiskFullParams:
    """disk-full: fill the filesystem the durable tier writes to."""

    seconds: float = knob(20.0, "how long the disk stays full")


@dataclass
class StoreFullParams:
    """store-full: fill the filesystem of the node stores (snapshot.store_dir, a small volume)."""

    seconds: float = knob(20.0, "how long the node stores stay full")


@dataclass
class SlowParams:
    """slow-rank / slow-host: a SIGSTOP/SIGCONT duty cycle on a worker or a node's workers (chaos.slow)."""

    factor: float = knob(2.0, "slow-down: everything the target computes takes this many times as long (> 1)")
    seconds: float = knob(20.0, "how long the target stays slow; 0 = until the run ends")
    period_ms: float = knob(20.0, "duty-cycle period: stopped for period·(1 - 1/factor), then running")


@dataclass
class AgentStallParams:
    """agent-stall: a node's agent (alone) stopped in bursts, as a loaded host stalls it (chaos.slow.AgentStall)."""

    stall_seconds: float = knob(5.0, "each burst stops the agent this long: longer than launch.node_lease_ttl (the lease lapses), shorter than launch.loss_confirm_bound (60 s; no loss may be declared)")
    run_seconds: float = knob(5.0, "the agent runs this long between bursts")
    seconds: float = knob(30.0, "how long the bursts go on; 0 = until the run ends")


@dataclass
class FirstAgentLostParams:
    """first-agent-lost: the agent whose claim runs the run dir's embedded etcd (the first one)
    lost with its machine: kill -9 of its process tree, its etcd member among it, and that
    member's data dir and the node's RAM store deleted (needs topology.etcd = 'embedded')."""

    remove_data: bool = knob(True, "delete the lost etcd member's data dir, as a lost machine loses its disk")
    remove_shm: bool = knob(True, "delete the node's RAM store, as a lost machine loses its RAM")


@dataclass
class SlowLinkParams:
    """slow-link: a low rate of dropped packets into one node (or from one peer): TCP
    retransmits stretch every transfer through it (needs topology.network = 'netns')."""

    probability: float = knob(0.02, "share of packets dropped, in (0, 1]: 0.1% already costs TCP a third of its throughput")
    seconds: float = knob(20.0, "how long the link stays slow")


@dataclass
class ScaleParams:
    """scale-down / scale-up: remove a node gracefully, or add one back."""

    nodes: int = knob(1, "how many nodes leave or join")


PARAMS_BY_KIND: dict[str, type] = {
    "kill-worker": KillParams,
    "kill-node": KillParams,
    "hang": HangParams,
    "preemption": PreemptParams,
    "partition": NetParams,
    "link-cut": NetParams,
    "packet-loss": NetParams,
    "delay": ProxyParams,
    "bandwidth": ProxyParams,
    "reset": ProxyParams,
    "etcd-loss": EtcdLossParams,
    "embedded-etcd-kill": EtcdKillParams,
    "storage-flaky": StorageParams,
    "bitflip": BitflipParams,
    "disk-full": DiskFullParams,
    "store-full": StoreFullParams,
    "scale-down": ScaleParams,
    "scale-up": ScaleParams,
    "slow-rank": SlowParams,
    "slow-host": SlowParams,
    "slow-link": SlowLinkParams,
    "agent-stall": AgentStallParams,
    "first-agent-lost": FirstAgentLostParams,
}
FAULT_KINDS = tuple(PARAMS_BY_KIND)
# Kinds that need the agents' own embedded etcd (topology.etcd = "embedded", loopback): not in
# the soak, whose nodes live in network namespaces behind the runner's proxied etcd.
EMBEDDED_ETCD_KINDS = ("first-agent-lost",)

# What a target string may name, per kind: "rank:3", "node:1", "node:random",
# "link:0-1", "etcd:0", "etcd", "durable", "rendezvous".
_TARGET_SCOPES = {
    "kill-worker": ("rank",), "hang": ("rank", "node", "agent"), "preemption": ("node", "rank", "all"),
    "kill-node": ("node",), "partition": ("node",), "link-cut": ("link",), "packet-loss": ("node", "link"),
    "delay": ("etcd", "rendezvous"), "bandwidth": ("etcd", "rendezvous"),
    "reset": ("etcd", "rendezvous"), "etcd-loss": ("etcd",), "embedded-etcd-kill": ("etcd",), "storage-flaky": ("durable",),
    "bitflip": ("rank",), "disk-full": ("durable", "local"), "store-full": ("local",), "scale-down": ("node",), "scale-up": ("node",),
    "slow-rank": ("rank",), "slow-host": ("node",), "slow-link": ("node", "link"),
    "agent-stall": ("node",),
    "first-agent-lost": ("etcd",),
}


@dataclass(frozen=True)
class Target:
    """A parsed target: ``scope`` plus up to two indices (None = random)."""

    scope: str
    index: int | None = None
    other: int | None = None

    def __str__(self) -> str:
        if self.scope == "link":
            return f"link:{self.index}-{self.other}"
        if self.index is None:
            return self.scope if self.scope in ("durable", "all", "etcd", "rendezvous", "local") else f"{self.scope}:random"
        return f"{self.scope}:{self.index}"


def parse_target(text: str, kind: str, source: str = "<scenario>") -> Target:
    """Parse ``"rank:1"``, ``"node:random"``, ``"link:0-1"``, ``"etcd"``..."""
    scope, _, rest = text.partition(":")
    allowed = _TARGET_SCOPES[kind]
    if scope not in allowed:
        raise ConfigError(f"{source}: fault '{kind}' cannot target {text!r}; use one of {', '.join(s + ':…' for s in allowed)}")
    try:
        if scope == "link":
            a, b = rest.split("-")
            return Target("link", int(a), int(b))
        if rest in ("", "random"):
            return Target(scope)
        return Target(scope, int(rest))
    except ValueError:
        raise ConfigError(f"{source}: bad target {text!r}; expected e.g. 'rank:1', 'node:random', 'link:0-1'") from None


# --------------------------------------------------------------------------
@dataclass
class FaultSpec:
    """One [[faults]] entry: what, where, when. Exactly one `when` is set."""

    kind: str = knob("", "fault kind", choices=FAULT_KINDS)
    target: str = knob("", "what to hit: 'rank:N', 'node:N', 'node:random', 'link:A-B', 'etcd', 'durable', ...")
    at_step: int = knob(-1, "inject when the run first reaches this optimizer step")
    at_seconds: float = knob(-1.0, "inject this long after training starts")
    rate_per_minute: float = knob(0.0, "inject at random times, this many per minute on average (seeded)")
    count: int = knob(1, "rate and paced faults: this many; at_step/at_seconds: always 1")
    paced: bool = knob(False, "inject `count` of these one at a time, each as soon as the job recovered from the previous fault (every seat filled, `pace_steps` steps made): faults as fast as the run recovers")
    params: dict = _many(dict, "parameters of this kind (see the kind's table)")
    recovery_bound_seconds: float = knob(0.0, "bound from fault to the first step after restore; 0 = the scenario's default")
    pace_steps: int = knob(0, "paced: steps the job must make with every seat filled before this fault fires; 0 = the scenario's pace_steps. A fail-slow fault needs the detector's warm-up (failslow.warmup steps of the worker group) behind it, or its slowness becomes the baseline")
    # Filled in by validation, never read from TOML.
    parsed_target: Target | None = field(default=None, metadata={"internal": True})
    parsed_params: Any = field(default=None, metadata={"internal": True})


@dataclass
class Topology:
    """The simulated cluster: one agent per node, its workers under it."""

    nodes: int = knob(2, "agents (simulated nodes) started at launch")
    workers_per_node: int = knob(2, "worker processes per agent")
    spares: int = knob(0, "spare nodes started warm, beyond `nodes`")
    min_nodes: int = knob(0, "--nnodes MIN; 0 = nodes (no shrinking below the start size)")
    failure_domains: list[str] = _many(list, "failure domain of each node (rack/zone label); empty = one domain per node")
    network: str = knob("loopback", "loopback: every node on 127.0.0.1; netns: each node in its own network namespace (needed for partition, link-cut, packet-loss)", choices=("loopback", "netns"))
    etcd_members: int = knob(1, "etcd members started for the rendezvous (topology.etcd = 'external')")
    etcd: str = knob("external", "external: the runner starts etcd_members members and every agent gets --rdzv-endpoint; embedded: no --rdzv-endpoint, the agents' own embedded etcd, grown into a cluster of launch.etcd_members (needed for first-agent-lost; loopback only)", choices=("external", "embedded"))
    proxy: list[str] = _many(list, "services reached through the TCP proxy (needed for delay/bandwidth/reset): 'etcd', 'rendezvous'")
    rdzv_conf: list[str] = _many(list, "extra `--rdzv-conf` settings of every agent, e.g. 'store_timeout=20'")


@dataclass
class Training:
    """Which run config to train, with scenario-specific overrides."""

    config: str = knob("configs/demo.toml", "run config (TOML), relative to the repository root or absolute")
    overrides: list[str] = _many(list, "`--set` overrides, e.g. 'train.steps=60'")
    reference: bool = knob(True, "also run the fault-free reference with the same seed, for the final-state check")


@dataclass
class Properties:
    """What must hold after the run, with its tolerances and bounds."""

    no_committed_step_lost: bool = knob(True, "every restore is at or after the newest step committed before the fault at a tier that survives it")
    commit_exactly_once: bool = knob(True, "no (tier, step) is committed twice, unless a restore to an earlier step came between")
    final_state: str = knob("bitwise", "final parameters against the reference", choices=("bitwise", "tolerance", "skip"))
    tolerance: float = knob(0.0, "final_state = 'tolerance': max |reference - run| allowed (after a resize)")
    recovery_bound_seconds: float = knob(60.0, "default bound from a fault to the first step after the restore")
    training_completes: bool = knob(True, "the run reaches its last step")
    no_leaks: bool = knob(True, "no process, listening port or /dev/shm entry of the run survives it")
    straggler_within_steps: int = knob(0, "slow-rank/slow-host/slow-link faults: a `straggler` event naming the target with the right cause within this many steps of the injection; 0 = not checked")
    surviving_tiers: dict = _many(dict, "per fault kind, the tiers that must survive it (overrides the defaults), e.g. {kill-node = ['peer', 'durable']}")


@dataclass
class Scenario:
    """A whole chaos scenario file."""

    name: str = knob("", "short name, used for the output folder")
    description: str = knob("", "what this scenario shows")
    seed: int = knob(0, "seed of random targets and random-rate fault times")
    budget_seconds: float = knob(600.0, "wall-clock budget for the faulted run; exceeding it fails the campaign")
    pace_steps: int = knob(2, "paced faults: steps the job must make with every seat filled after a fault ended before the next fires")
    pace_timeout_seconds: float = knob(180.0, "paced faults: a job not recovered this long after a fault ended gets the next fault anyway (and the report says so)")
    topology: Topology = field(default_factory=Topology)
    training: Training = field(default_factory=Training)
    faults: list = _many(list, "the [[faults]] tables")
    properties: Properties = field(default_factory=Properties)
    source: str = field(default="<scenario>", compare=False, metadata={"internal": True})

    @property
    def budget(self) -> timedelta:
        return timedelta(seconds=self.budget_seconds)

    def recovery_bound(self, fault: FaultSpec) -> timedelta:
        s = fault.recovery_bound_seconds or self.properties.recovery_bound_seconds
        return timedelta(seconds=s)

    def plan(self, duration: timedelta | None = None) -> list["PlannedFault"]:
        """The concrete faults, in order: step faults first by step, then
        timed faults by time. Random times and random targets are drawn from
        ``random.Random(seed)``, so the same file gives the same campaign."""
        return plan_faults(self, duration or self.budget)


@dataclass(frozen=True)
class PlannedFault:
    """One fault to inject: a stable ``fault_id``, its spec and its trigger."""

    fault_id: str
    kind: str
    target: Target
    params: Any
    at_step: int | None
    at: timedelta | None
    recovery_bound: timedelta
    pace_steps: int = 0   # paced: steps at full strength before it fires (0: the scenario's)

    @property
    def paced(self) -> bool:
        return self.at_step is None and self.at is None

    def describe(self) -> str:
        when = (f"step {self.at_step}" if self.at_step is not None else
                "recovery of the previous fault" if self.at is None else f"t+{self.at.total_seconds():.1f}s")
        return f"{self.fault_id}: {self.kind} → {self.target} at {when}"


def _resolve_target(t: Target, rng: random.Random, topo: Topology, kind: str) -> Target:
    """Pick a concrete index for 'random' targets from the topology. A bare
    'etcd' is the whole service (proxy faults) except for etcd-loss and
    embedded-etcd-kill, which need a member."""
    if t.index is not None or t.scope in ("durable", "all", "etcd", "rendezvous", "local"):
        if t.scope == "etcd" and t.index is None and kind in ("etcd-loss", "embedded-etcd-kill"):
            return Target("etcd", rng.randrange(topo.etcd_members))
        return t
    if t.scope == "rank":
        return Target("rank", rng.randrange(topo.nodes * topo.workers_per_node))
    return Target(t.scope, rng.randrange(topo.nodes))


def plan_faults(sc: Scenario, duration: timedelta) -> list[PlannedFault]:
    rng = random.Random(sc.seed)
    planned: list[PlannedFault] = []
    for i, f in enumerate(sc.faults):
        bound = sc.recovery_bound(f)
        base = dict(kind=f.kind, params=f.parsed_params, recovery_bound=bound)
        if f.at_step >= 0:
            planned.append(PlannedFault(f"f{i}", target=_resolve_target(f.parsed_target, rng, sc.topology, f.kind), at_step=f.at_step, at=None, **base))
        elif f.at_seconds >= 0:
            planned.append(PlannedFault(f"f{i}", target=_resolve_target(f.parsed_target, rng, sc.topology, f.kind), at_step=None, at=timedelta(seconds=f.at_seconds), **base))
        elif f.paced:
            continue  # below: interleaved with the other paced kinds
        else:
            t, n = 0.0, 0
            while n < f.count:
                t += rng.expovariate(f.rate_per_minute / 60.0)
                if t >= duration.total_seconds():
                    break
                planned.append(PlannedFault(f"f{i}.{n}", target=_resolve_target(f.parsed_target, rng, sc.topology, f.kind), at_step=None, at=timedelta(seconds=t), **base))
                n += 1
    planned.sort(key=lambda p: (p.at_step is None, p.at_step or 0, p.at or timedelta(0)))
    return planned + _plan_paced(sc, rng)


def _plan_paced(sc: Scenario, rng: random.Random) -> list[PlannedFault]:
    """Paced faults in seeded rounds: each round takes one of every kind
    still owed, in a shuffled order, so a soak cut short by its budget has
    hit every kind about equally often. A scale-up is placed right after a
    scale-down and brings back the node it stopped."""
    specs = [(i, f) for i, f in enumerate(sc.faults) if f.paced]
    ups = [(i, f) for i, f in specs if f.kind == "scale-up"]
    specs = [(i, f) for i, f in specs if f.kind != "scale-up"]
    made = {i: 0 for i, _ in specs + ups}
    out: list[PlannedFault] = []

    def one(i: int, f: FaultSpec, target: Target | None = None) -> PlannedFault:
        n = made[i]
        made[i] += 1
        t = target or _resolve_target(f.parsed_target, rng, sc.topology, f.kind)
        return PlannedFault(f"f{i}.{n}", f.kind, t, f.parsed_params, None, None, sc.recovery_bound(f), f.pace_steps)

    for _ in range(max([f.count for _, f in specs + ups], default=0)):
        due = [(i, f) for i, f in specs if made[i] < f.count]
        rng.shuffle(due)
        for i, f in due:
            out.append(one(i, f))
            up = next(((j, u) for j, u in ups if made[j] < u.count), None)
            if f.kind == "scale-down" and up is not None:
                out.append(one(up[0], up[1], Target("node", out[-1].target.index)))
    for j, u in ups:  # scale-ups without a scale-down to follow
        while made[j] < u.count:
            out.append(one(j, u))
    return out


# --------------------------------------------------------------------------
def _validate_fault(f: FaultSpec, i: int, sc: Scenario) -> None:
    src = sc.source
    where = f"faults[{i}]"
    if not f.kind:
        raise ConfigError(f"{src}: {where}.kind is required; one of {', '.join(FAULT_KINDS)}")
    whens = [f.at_step >= 0, f.at_seconds >= 0, f.rate_per_minute > 0, f.paced]
    if sum(whens) != 1:
        raise ConfigError(f"{src}: {where} needs exactly one of at_step, at_seconds, rate_per_minute, paced (got {sum(whens)})")
    if f.count < 1:
        raise ConfigError(f"{src}: {where}.count must be ≥ 1")
    if f.pace_steps < 0 or (f.pace_steps and not f.paced):
        raise ConfigError(f"{src}: {where}.pace_steps = {f.pace_steps}: a paced fault's own pace, in steps ≥ 0")
    f.parsed_target = parse_target(f.target, f.kind, f"{src} {where}")
    n_ranks = sc.topology.nodes * sc.topology.workers_per_node
    t = f.parsed_target
    limit = {"rank": n_ranks, "node": sc.topology.nodes + sc.topology.spares, "agent": sc.topology.nodes, "link": sc.topology.nodes, "etcd": sc.topology.etcd_members}.get(t.scope)
    for idx in (t.index, t.other):
        if limit is not None and idx is not None and not 0 <= idx < limit:
            raise ConfigError(f"{src}: {where}.target {f.target!r} is out of range (topology has {limit} {t.scope}s)")
    f.parsed_params = load_section(PARAMS_BY_KIND[f.kind], f.params, f"{where}.params", src)
    p = f.parsed_params
    if f.kind == "packet-loss" and not 0 < p.probability <= 1:
        raise ConfigError(f"{src}: {where}.params.probability must be in (0, 1] for packet-loss")
    if f.kind == "delay" and p.delay_ms <= 0:
        raise ConfigError(f"{src}: {where}.params.delay_ms must be > 0 for delay")
    if f.kind == "bandwidth" and p.bytes_per_second <= 0:
        raise ConfigError(f"{src}: {where}.params.bytes_per_second must be > 0 for bandwidth")
    if f.kind in ("slow-rank", "slow-host") and not (p.factor > 1 and p.period_ms > 0):
        raise ConfigError(f"{src}: {where}.params needs factor > 1 and period_ms > 0 for {f.kind} (got factor {p.factor}, period_ms {p.period_ms})")
    if f.kind == "agent-stall" and not (p.stall_seconds > 0 and p.run_seconds > 0):
        raise ConfigError(f"{src}: {where}.params needs stall_seconds > 0 and run_seconds > 0 for agent-stall")
    if f.kind == "slow-link" and not 0 < p.probability <= 1:
        raise ConfigError(f"{src}: {where}.params.probability must be in (0, 1] for slow-link")
    if f.kind in ("partition", "link-cut", "packet-loss", "slow-link") and sc.topology.network != "netns":
        raise ConfigError(f"{src}: {where} ({f.kind}) needs topology.network = 'netns'")
    if f.kind in ("delay", "bandwidth", "reset") and t.scope not in sc.topology.proxy:
        raise ConfigError(f"{src}: {where} ({f.kind} on {t.scope}) needs topology.proxy to include '{t.scope}'")
    embedded = sc.topology.etcd == "embedded"
    if f.kind == "first-agent-lost" and not embedded:
        raise ConfigError(f"{src}: {where} (first-agent-lost) needs topology.etcd = 'embedded': the agents' own etcd")
    if embedded and f.kind in ("etcd-loss", "embedded-etcd-kill", "delay", "bandwidth", "reset"):
        raise ConfigError(f"{src}: {where} ({f.kind}) acts on the runner's etcd or its proxy: topology.etcd = 'external'")
    if f.kind == "etcd-loss" and p.members > sc.topology.etcd_members:
        raise ConfigError(f"{src}: {where} stops {p.members} etcd members but topology.etcd_members = {sc.topology.etcd_members}")


def scenario_from_dict(table: dict, source: str = "<dict>") -> Scenario:
    """Build and validate a Scenario from a parsed TOML table."""
    table = dict(table)
    raw_faults = table.pop("faults", [])
    if not isinstance(raw_faults, list):
        raise ConfigError(f"{source}: 'faults' must be an array of tables ([[faults]])")
    sc: Scenario = load_section(Scenario, table, "", source)
    sc.source = source
    sc.faults = [load_section(FaultSpec, f, f"faults[{i}]", source) for i, f in enumerate(raw_faults)]
    topo = sc.topology
    if not sc.name:
        raise ConfigError(f"{source}: 'name' is required")
    if topo.nodes < 1 or topo.workers_per_node < 1:
        raise ConfigError(f"{source}: topology.nodes and topology.workers_per_node must be ≥ 1")
    if topo.failure_domains and len(topo.failure_domains) != topo.nodes + topo.spares:
        raise ConfigError(f"{source}: topology.failure_domains names {len(topo.failure_domains)} domains for {topo.nodes + topo.spares} nodes (nodes + spares)")
    if topo.min_nodes > topo.nodes:
        raise ConfigError(f"{source}: topology.min_nodes = {topo.min_nodes} exceeds nodes = {topo.nodes}")
    if topo.etcd == "embedded" and (topo.network != "loopback" or topo.proxy):
        raise ConfigError(f"{source}: topology.etcd = 'embedded' runs on loopback without a proxy (its members "
                          "listen on 127.0.0.1): network = 'loopback', proxy = []")
    for svc in topo.proxy:
        if svc not in ("etcd", "rendezvous"):
            raise ConfigError(f"{source}: topology.proxy entry {svc!r} is not 'etcd' or 'rendezvous'")
    for kind, tiers in sc.properties.surviving_tiers.items():
        if kind not in FAULT_KINDS or not isinstance(tiers, list) or any(t not in TIERS for t in tiers):
            raise ConfigError(f"{source}: properties.surviving_tiers.{kind} must name a fault kind and a list of {TIERS}")
    if not 0 < sc.budget_seconds <= MAX_SECONDS:
        raise ConfigError(f"{source}: budget_seconds must be > 0 and ≤ {MAX_SECONDS:g}")
    for i, f in enumerate(sc.faults):
        for key in ("at_seconds", "recovery_bound_seconds"):
            if getattr(f, key) > MAX_SECONDS:
                raise ConfigError(f"{source}: faults[{i}].{key} must be ≤ {MAX_SECONDS:g}")
    for i, f in enumerate(sc.faults):
        _validate_fault(f, i, sc)
    return sc


MAX_SECONDS = 1e7  # ~4 months: past it a timedelta overflows, and no campaign runs that long


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Read a scenario TOML; a bare name ('kill-worker') means a shipped one."""
    p = Path(path)
    if not p.exists() and not p.suffix and (SCENARIO_DIR / f"{p}.toml").exists():
        p = SCENARIO_DIR / f"{p}.toml"
    try:
        table = read_toml(p, "scenario")
    except FileNotFoundError:
        shipped = ", ".join(sorted(x.stem for x in SCENARIO_DIR.glob("*.toml")))
        raise ConfigError(f"scenario {path} does not exist; shipped scenarios: {shipped}") from None
    return scenario_from_dict(table, str(p))


def shipped_scenarios() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.toml"))


def as_dict(sc: Scenario) -> dict:
    """A JSON-able summary (for results.json)."""
    d = {k: v for k, v in dataclasses.asdict(sc).items() if k not in ("faults", "source")}
    d["faults"] = [{"kind": f.kind, "target": f.target, "at_step": f.at_step, "at_seconds": f.at_seconds, "rate_per_minute": f.rate_per_minute, "paced": f.paced, "count": f.count, "params": f.params} for f in sc.faults]
    d["source"] = sc.source
    return d
