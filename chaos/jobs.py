"""The job under test: etcd members and one ``resilient launch`` agent per
simulated node, with the handles the fault driver needs.

Why a module of its own: the runner must know, at every moment of an
elastic job, which pid is rank 3 (ranks move between rounds), which process
tree is node 1, what that node holds in ``/dev/shm``, and it must be able to
stop and start nodes and etcd members — and whatever happens (a failed
injection, a budget overrun, a crash of the runner itself) every process it
started must be gone afterwards, or the leak check and the next campaign
would judge the leftovers. :class:`LocalJob` is the
:class:`~.campaign.JobHandles` of a job whose nodes are agents on this
machine (optionally each in its own network namespace); :class:`EtcdService`
is its coordination store, one or several real etcd members.

Everything the handles answer is read from the job's own event log
(``workers_started``, ``rendezvous``) and from ``/proc``, never from what the
runner assumes, so a handle cannot point at a process that is not there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

from resilient.contract import events_path
from resilient.etcd.cluster import EtcdCluster
from resilient.events import read_events

from .injectors import InjectionFailed
from .launched import REPO, LaunchedNode, launch_argv  # noqa: F401  (REPO: the runner's)
from .scenario import Scenario

SHM_DIR = "/dev/shm"
SAMPLE_EVERY = timedelta(milliseconds=500)
THREAD_JOIN = timedelta(seconds=5)
# A SIGTERMed agent gives its workers launch.preemption_grace (the runner's
# jobs set it low) before SIGKILL, then cleans up.
STOP_GRACE = timedelta(seconds=30)
KILL_WAIT = timedelta(seconds=10)
# After the last rank wrote run_end, how long nodes that are still up (a
# spare never admitted, a straggler) get to leave on their own. Longer than
# a heartbeat timeout: a worker hung at exit is caught by its agent, and the
# runner then reports that failure by name rather than a timeout of its own.
END_GRACE = timedelta(seconds=60)


# The cluster lives in the runtime (the tests and the control-plane simulator start it too);
# the harness's name for it stays.
EtcdService = EtcdCluster


def _quiet(fn: Any) -> Any:
    with contextlib.suppress(psutil.Error):
        return fn()
    return ""


def shm_in_use(pids: list[int]) -> set[str]:
    """``/dev/shm`` files these processes map or hold open (read from
    ``/proc``: cheap, unlike psutil's smaps-based ``memory_maps``)."""
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM_DIR + "/")
                    if i >= 0:
                        found.add(line[i:].strip().removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(SHM_DIR + "/"):
                        found.add(target.removesuffix(" (deleted)"))
    return found


class LocalJob:
    """One training job: an agent per node (``n0``, ``n1``, …; spares come
    after the nodes) as subprocesses in sessions of their own.

    Implements :class:`~.campaign.JobHandles`. Use as a context manager:
    leaving it kills every node's process tree, even when the body failed.
    """

    def __init__(self, sc: Scenario, run_dir: Path, config: Path, overrides: list[str], endpoint: str, *,
                 spares: int | None = None, netlab: Any = None, proxies: dict | None = None,
                 durable_path: Path | None = None, control_dir: Path | None = None,
                 etcd_members: list | None = None, env: dict[str, str] | None = None) -> None:
        topo = sc.topology
        self.sc, self.run_dir, self.config, self.overrides, self.endpoint = sc, Path(run_dir), Path(config), list(overrides), endpoint
        self.nodes = topo.nodes
        self.spares = topo.spares if spares is None else spares
        self.nproc = topo.workers_per_node
        self.nnodes = f"{topo.min_nodes or topo.nodes}:{topo.nodes}"
        self.domains = list(topo.failure_domains) or [f"domain-{i}" for i in range(self.nodes + self.spares)]
        self.netlab, self.proxies, self.durable_path = netlab, dict(proxies or {}), durable_path
        self.control_dir = control_dir or self.run_dir / "chaos" / "control"
        self.etcd_members = list(etcd_members or [])
        self.env = dict(env or {})
        # Our own run id (not the one launch derives from the run dir): it
        # names the job's node stores, STORE_DIR/resilient-<run_id>/<node>.
        self.run_id = f"chaos-{sc.name}-{uuid.uuid4().hex[:8]}"
        self.store_dir = Path(_store_dir(self.config, self.overrides))
        self.procs: dict[int, subprocess.Popen] = {}
        self.launches: dict[int, int] = {}
        self.launched_at: dict[int, float] = {}
        self.agent_pids: dict[int, str] = {}  # every agent pid launched -> its node id
        self.launched: list[LaunchedNode] = []   # every agent started, restarts too: all killed on close
        self.launched_node: dict[int, LaunchedNode] = {}   # node -> its newest launch (procs[n] is its process)
        self.shm_seen: dict[int, set[str]] = {}
        self.pids_seen: dict[int, float] = {}  # pid -> create time, of every process seen in a node's tree
        self.orphans: list[str] = []
        self._lock = threading.Lock()
        self._events_lock = threading.Lock()
        self._events: list[dict] = []
        self._by_kind: dict[str, list[dict]] = {}
        self._events_offset = 0
        self._stop_sampler = threading.Event()
        self._sampler: threading.Thread | None = None
        self.log_dir = self.run_dir / "logs"

    # -- names --------------------------------------------------------------
    @staticmethod
    def node_id(n: int) -> str:
        return f"n{n}"

    def node_index(self, node_id: str) -> int | None:
        return int(node_id[1:]) if node_id.startswith("n") and node_id[1:].isdigit() else None

    # -- life cycle ---------------------------------------------------------
    def _launch(self, n: int) -> subprocess.Popen:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        k = self.launches.get(n, 0)
        self.launches[n] = k + 1
        env = dict(self.env)
        overrides, conf = list(self.overrides), list(self.sc.topology.rdzv_conf)
        if self.netlab is not None:
            # In its own namespace a node's hostname resolves to a loopback the
            # others cannot reach: advertise its lab address to the rendezvous
            # (MASTER_ADDR) and the peer store, and bind gloo to its interface.
            addr = self.netlab.addresses[n]
            conf.append(f"local_addr={addr}")
            overrides.append(f"snapshot.store_host={addr}")
            env["GLOO_SOCKET_IFNAME"] = self.netlab.interface(n)
        cmd = launch_argv(self.config, self.run_dir, node_id=self.node_id(n), nnodes=self.nnodes,
                          endpoint=self.endpoint,   # none: the embedded etcd
                          nproc=self.nproc, overrides=overrides,
                          extra_args=["--domain", self.domains[n % len(self.domains)], "--run-id", self.run_id,
                                      *(["--rdzv-conf", ",".join(conf)] if conf else [])])
        if self.netlab is not None:
            cmd = self.netlab.exec_prefix(n) + cmd
        # SIGTERMed if the runner dies, even by SIGKILL: a killed campaign leaves no job behind. The
        # signal follows the *thread* that started the agent: the runner's main thread, or the fault
        # driver's (scale-up), which lives until the job is stopped anyway.
        node = LaunchedNode(cmd, self.log_dir / f"agent-{self.node_id(n)}{'' if k == 0 else f'.{k}'}.log",
                            env=env, term_with_parent=True)
        self.launched.append(node)
        self.launched_node[n] = node
        proc = self.procs[n] = node.proc
        self.launched_at[n] = time.time()
        self.agent_pids[proc.pid] = self.node_id(n)
        return proc

    def start(self, formed_timeout: timedelta = timedelta(minutes=3)) -> "LocalJob":
        """Start the nodes, and the spares once the nodes formed their first
        round: a spare started with them could take a node's seat, and
        ``node:1`` would no longer name the process the scenario means."""
        for n in range(self.nodes):
            self._launch(n)
        self._sampler = threading.Thread(target=self._sample_loop, name="chaos-shm-sampler", daemon=True)
        self._sampler.start()
        if self.spares:
            want = {self.node_id(n) for n in range(self.nodes)}
            deadline = time.monotonic() + formed_timeout.total_seconds()
            while not any(set(e.get("nodes", [])) == want for e in self.events("rendezvous")):
                self._check_not_all_dead()
                if time.monotonic() > deadline:
                    raise InjectionFailed(f"the {self.nodes} nodes did not form a round within {formed_timeout}; see {self.log_dir}")
                time.sleep(0.2)
            for s in range(self.spares):
                self._launch(self.nodes + s)
        return self

    def _check_not_all_dead(self) -> None:
        if self.procs and all(p.poll() is not None for p in self.procs.values()):
            raise InjectionFailed(f"every agent exited before the job formed; see {self.log_dir}")

    def events(self, kind: str | None = None) -> list[dict]:
        """The job's events so far (of one kind): read incrementally, since
        a soak's log grows to tens of MB and the handles ask often."""
        with self._events_lock:
            path = events_path(self.run_dir)
            try:
                with open(path, "rb") as f:
                    f.seek(self._events_offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            end = data.rfind(b"\n") + 1  # a line still being written waits
            self._events_offset += end
            for line in data[:end].splitlines():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line of a killed writer
                self._events.append(e)
                self._by_kind.setdefault(e.get("event"), []).append(e)
            return list(self._events if kind is None else self._by_kind.get(kind, []))

    def finished(self) -> bool:
        """Every rank of the newest layout wrote its final ``run_end``."""
        starts = self.events("run_start")
        if not starts:
            return False
        world = int(starts[-1].get("layout", {}).get("world", 0))
        ends = {e["rank"] for e in self.events("run_end") if "param_digest" in e and e["time"] >= starts[-1]["time"]}
        return world > 0 and all(r in ends for r in range(world))

    def wait(self, budget: timedelta, poll: timedelta = timedelta(milliseconds=500), until: Any = None) -> str:
        """Block until the job ends: 'finished' (training finished and every
        agent exited), 'hung' (training finished but agents were still up
        END_GRACE later: a job that cannot end is a bug too), 'exited'
        (every agent exited without finishing), 'budget', or 'faults done'
        when ``until()`` says so (a soak ends with its last fault)."""
        deadline = time.monotonic() + budget.total_seconds()
        done_at: float | None = None
        while time.monotonic() < deadline:
            if until is not None and until():
                return "faults done"
            with self._lock:
                alive = [n for n, p in self.procs.items() if p.poll() is None]
            fin = self.finished()
            if not alive:
                return "finished" if fin else "exited"
            if fin:
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > END_GRACE.total_seconds():
                    return "hung"
            time.sleep(poll.total_seconds())
        return "budget"

    def close(self) -> None:
        """Stop every node that is still up: SIGTERM first (the agent stops
        its workers and removes its node store, as on a preemption), then
        SIGKILL the trees of those still there after STOP_GRACE."""
        self._stop_sampler.set()
        if self._sampler is not None:
            self._sampler.join(THREAD_JOIN.total_seconds())
        with self._lock:
            procs = list(self.procs.values())
        alive = [p for p in procs if p.poll() is None]
        # What outlived its agent before we touched anything: leaks of the
        # job itself (the runner's leak check reports them), then killed.
        trees = {q for n in self.procs for q in self._tree_pids(n)}
        self.orphans = [f"process {q.pid} ({' '.join(_quiet(q.cmdline) or [])[:80]}) outlived its agent"
                        for q in self.leftovers() if q.pid not in trees]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE.total_seconds()
        try:
            for p in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
        finally:  # a second Ctrl-C cuts the grace short, never the kill
            for node in self.launched:
                node.kill(KILL_WAIT)
            # Orphans: workers of an agent that died before them (the agent's
            # tree no longer reaches them).
            left = [p for p in self.leftovers()]
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(left, timeout=KILL_WAIT.total_seconds())
            for node in self.launched:
                node.close()

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- shared memory ------------------------------------------------------
    def _tree_pids(self, n: int) -> list[int]:
        p = self.procs.get(n)
        if p is None or p.poll() is not None:
            return []
        try:
            root = psutil.Process(p.pid)
            family = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for q in family:
            with contextlib.suppress(psutil.Error):
                self.pids_seen.setdefault(q.pid, q.create_time())
        return [q.pid for q in family]

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this job still running: every process ever seen in a
        node's tree (same pid *and* start time, so a reused pid is not
        blamed), which are not zombies."""
        left = []
        for pid, created in list(self.pids_seen.items()):
            with contextlib.suppress(psutil.Error):
                q = psutil.Process(pid)
                if q.create_time() == created and q.status() != psutil.STATUS_ZOMBIE:
                    left.append(q)
        return left

    def _sample_loop(self) -> None:
        while not self._stop_sampler.wait(SAMPLE_EVERY.total_seconds()):
            for n in list(self.procs):
                found = shm_in_use(self._tree_pids(n))
                if found:
                    with self._lock:
                        self.shm_seen.setdefault(n, set()).update(found)

    @property
    def shm_prefix(self) -> str:
        """Every node store of this job starts with it (the leak check's prefix)."""
        return f"resilient-{self.run_id}"

    def all_shm(self) -> list[str]:
        """Every /dev/shm entry a process of this job was seen using (the
        leak check's list), as the entry directly under /dev/shm."""
        from resilient.snapshot.storeroot import user_root

        with self._lock:
            seen = set().union(*self.shm_seen.values()) if self.shm_seen else set()
        root = str(user_root(SHM_DIR)) + "/"  # node stores sit one level down, in this user's root
        return sorted({"/".join(p.split("/")[:5 if p.startswith(root) else 4]) for p in seen})

    # -- JobHandles ---------------------------------------------------------
    def seat(self, node: int) -> int:
        """The agent that holds seat ``node`` (group rank) of the newest
        round. A scenario's ``node:1`` means "the second node of the job",
        and after a spare took a seat that is no longer agent n1 (which may
        be idling as the spare now). Before the first round: agent ``node``."""
        rounds = self.events("rendezvous")
        if rounds:
            current = set(rounds[-1].get("nodes", []))
            for e in reversed(rounds):
                if e.get("node") in current and int(e.get("group_rank", -1)) == node:
                    idx = self.node_index(str(e["node"]))
                    if idx is not None and self.node_alive(idx):
                        return idx
        return node

    def node_pid(self, node: int) -> int:
        n = self.seat(node)
        p = self.procs.get(n)
        if p is None or p.poll() is not None:
            raise InjectionFailed(f"node {node} ({self.node_id(n)}) is not running")
        return p.pid

    def node_alive(self, node: int) -> bool:
        p = self.procs.get(node)
        return p is not None and p.poll() is None

    def node_store(self, node: int) -> Path:
        """The node's snapshot store tree (resilient/snapshot/nodestore.py)."""
        from resilient.snapshot.nodestore import job_dir

        return job_dir(self.store_dir, self.run_id) / self.node_id(node)

    def node_shm(self, node: int) -> list[str]:
        """The node's RAM: its store tree, and whatever else under /dev/shm
        its processes map or hold open now or were seen using (the
        sampler's record, should the processes be gone already). The kill
        injector asks before it kills, so the seat names the same agent
        as :meth:`node_pid` did."""
        node = self.seat(node)
        live = shm_in_use(self._tree_pids(node))
        with self._lock:
            seen = self.shm_seen.setdefault(node, set())
            seen.update(live)
            store = self.node_store(node)
            return sorted({str(store)} | {p for p in seen if not p.startswith(str(store.parent) + "/")})

    def rank_pid(self, rank: int) -> int:
        """The pid of global rank ``rank`` now: rank = group_rank × nproc +
        local_rank (torch's identical-workers assignment), from each live
        node's newest ``rendezvous`` and ``workers_started`` events."""
        evs = self.events()
        # Only the nodes of the newest round: a node left out of it (a spare
        # took its seat) still shows its own older round's workers.
        rounds = [e for e in evs if e.get("event") == "rendezvous"]
        current = set(rounds[-1].get("nodes", [])) if rounds else set()
        for n, p in sorted(self.procs.items()):
            node = self.node_id(n)
            if p.poll() is not None or node not in current:
                continue
            rdzv = [e for e in evs if e.get("event") == "rendezvous" and e.get("node") == node]
            started = [e for e in evs if e.get("event") == "workers_started" and e.get("node") == node]
            if not rdzv or not started or started[-1].get("round") != rdzv[-1].get("round"):
                continue
            base = int(rdzv[-1]["group_rank"]) * self.nproc
            for local, pid in zip(started[-1]["local_ranks"], started[-1]["pids"]):
                if base + int(local) == rank and psutil.pid_exists(pid):
                    return int(pid)
        raise InjectionFailed(f"no running worker has rank {rank} (is the job between rounds?)")

    def stop_node(self, node: int) -> str:
        """Scale down: SIGTERM agent ``node`` (it hands its state over and
        leaves the rendezvous), SIGKILL the tree if it overstays STOP_GRACE.
        Scale faults name agents (n0, n1, …), as scale-up must: a node that
        left holds no seat."""
        p = self.procs.get(node)
        if p is None or p.poll() is not None:
            raise InjectionFailed(f"node {node} is not running")
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(STOP_GRACE.total_seconds())
            return f"node {self.node_id(node)} left (exit {p.returncode})"
        except subprocess.TimeoutExpired:
            self.launched_node[node].kill(KILL_WAIT)
            return f"node {self.node_id(node)} killed after {STOP_GRACE}"

    def start_node(self, node: int) -> str:
        """Scale up: start node ``node``'s agent (again)."""
        if self.node_alive(node):
            raise InjectionFailed(f"node {node} is already running")
        return f"started {self.node_id(node)} as pid {self._launch(node).pid}"

    def heal(self, keep_down: set[int] = frozenset()) -> list[str]:
        """Start again every agent (nodes and spares) that has exited, but
        those in ``keep_down``: a replacement node arriving after a node was
        lost, so that a long campaign does not run out of nodes. Returns the
        node ids started."""
        with self._lock:
            dead = [n for n in range(self.nodes + self.spares)
                    if n not in keep_down and n in self.procs and self.procs[n].poll() is not None]
        for n in dead:
            self._launch(n)
        return [self.node_id(n) for n in dead]

    # -- results ------------------------------------------------------------
    def exit_codes(self) -> dict[str, int | None]:
        return {self.node_id(n): p.poll() for n, p in sorted(self.procs.items())}


def _store_dir(config: Path, overrides: list[str]) -> str:
    """snapshot.store_dir of the job's resolved config (/dev/shm by default)."""
    from resilient.gpt.config import load_config

    return str(getattr(load_config(config, overrides).snapshot, "store_dir", SHM_DIR))


def final_state(run_dir: Path) -> "FinalState | None":
    """The run's final parameters (per-rank digests of the newest layout)
    and its loss curve, from its event log; None if it never finished."""
    path = events_path(run_dir)
    if not path.exists():
        return None
    evs = list(read_events(path))
    starts = [e for e in evs if e.get("event") == "run_start"]
    if not starts:
        return None
    world = int(starts[-1].get("layout", {}).get("world", 0))
    digests: dict[int, str] = {}
    for e in evs:
        if e.get("event") == "run_end" and "param_digest" in e:
            digests[int(e["rank"])] = e["param_digest"]
    losses: dict[int, float] = {}
    for e in evs:
        if e.get("event") == "step" and isinstance(e.get("loss"), (int, float)):
            losses[int(e["step"])] = float(e["loss"])  # a recomputed step: the newest value
    if any(r not in digests for r in range(world)):
        return None
    return FinalState(world, {r: digests[r] for r in range(world)}, losses, starts[-1].get("layout", {}))


class FinalState:
    """What the final-state property compares. Two states of one layout are
    bitwise equal iff their digests are; after a resize the parameters are
    sharded differently and only the losses can be compared."""

    def __init__(self, world: int, digests: dict[int, str], losses: dict[int, float], layout: dict) -> None:
        self.world, self.digests, self.losses, self.layout = world, digests, losses, layout

    @property
    def digest(self) -> str:
        """One string for the whole model: layout + every rank's digest."""
        import hashlib

        h = hashlib.sha256(json.dumps(self.layout, sort_keys=True).encode())
        for r in sorted(self.digests):
            h.update(self.digests[r].encode())
        return f"{self.layout_key}:{h.hexdigest()}"

    @property
    def layout_key(self) -> str:
        lay = self.layout
        return f"pp{lay.get('pp')}-dp{lay.get('dp')}-tp{lay.get('tp')}"

    def to_dict(self) -> dict:
        return {"world": self.world, "layout": self.layout, "digest": self.digest, "steps": len(self.losses),
                "final_loss": self.losses[max(self.losses)] if self.losses else None}


def loss_diff(reference: FinalState, actual: FinalState) -> float:
    """Max |Δloss| over the steps both runs logged; 0 when the digests say
    the models are bitwise equal; inf when there is nothing to compare."""
    if reference.digest == actual.digest:
        return 0.0
    common = sorted(set(reference.losses) & set(actual.losses))
    if not common:
        return float("inf")
    return max(abs(reference.losses[s] - actual.losses[s]) for s in common)
