"""The properties a chaos run must satisfy, as pure functions of its timeline.

Each check returns a :class:`PropertyResult` with a detail that names the
offending events, so a failed campaign says *what* went wrong, not just that
something did. Definitions (the events are those of resilient.events):

* **no committed step lost** — for every ``restore`` (and every restart that
  skipped restoring), let F be the newest fault before it (a harness
  ``fault_injected``, else a runtime ``failure``; with neither, a resume at
  start, which only the durable tier must survive). Let C be the newest step
  committed, before F, at a tier that survives F's kind
  (:data:`SURVIVING_TIERS`). The restore's step must be ≥ C: the run never
  retrains from a point older than work it had already made safe.
* **commit exactly once** — no (tier, step) is committed twice, except when a
  restore to an *earlier* step came between the two commits (that version
  was lost with its tier and legitimately recomputed); optionally every
  expected (tier, step) is committed.
* **recovery bounded** — for each fault whose episode includes a restore (or
  whose kind always needs one), the time from ``fault_injected`` to the first
  ``step`` after the restore is at most the bound.
* **final state** — the faulted run's final parameters equal the reference's
  (digests), or differ by at most a tolerance (a ``diff`` function).
* **stragglers found** — for each slow-rank, slow-host or slow-link fault, a
  ``straggler`` event after its injection names it with the right cause (the
  rank, as a device; the node, as a host; the link, at its node or one of its
  two ends) within a bound in steps. A slow host whose node runs one worker is
  named as that node's device: with one rank there, nothing tells the two apart.
  Not judged, and listed: a fault on the idle spare, and one whose slow steps
  outlasted the heartbeat timeout, so that the job re-formed without the node
  before the bound (a ``failure`` event first).
* **no leaks** — after the run, no process mentions the run directory, no
  ``/dev/shm`` entry carries the job's prefix, no listed port is listening,
  no listed mount is mounted, no network lab is left.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import psutil

from .timeline import NOT_INJECTED, Episode, faults, tier_of

ALL_TIERS = ("local", "peer", "durable")

# Which tiers still hold their committed versions after each fault kind.
SURVIVING_TIERS: dict[str, tuple[str, ...]] = {
    "kill-worker": ALL_TIERS,
    "hang": ALL_TIERS,
    "kill-node": ("peer", "durable"),
    "preemption": ("peer", "durable"),
    "partition": ("peer", "durable"),
    "link-cut": ALL_TIERS,
    "packet-loss": ALL_TIERS,
    "delay": ALL_TIERS,
    "bandwidth": ALL_TIERS,
    "reset": ALL_TIERS,
    "etcd-loss": ALL_TIERS,
    "embedded-etcd-kill": ALL_TIERS,
    "storage-flaky": ALL_TIERS,
    "disk-full": ALL_TIERS,
    "store-full": ALL_TIERS,   # the versions already in RAM stay; new ones land in the other tiers
    # A flip taints the versions committed after it: a rollback to an older
    # version is the correct response, so no tier binds the restore.
    "bitflip": (),
    "scale-down": ("peer", "durable"),
    "scale-up": ALL_TIERS,
    "slow-rank": ALL_TIERS,   # slow, never lost: nothing is restored
    "slow-host": ALL_TIERS,
    "slow-link": ALL_TIERS,
    "agent-stall": ALL_TIERS,  # stalled, never lost: nothing is restored
    "first-agent-lost": ("peer", "durable"),   # a lost node: its RAM is gone
    "failure": ("durable",),  # a failure the harness did not cause
    "start": ("durable",),    # a resume at launch
}

# Fault kinds after which the job must restore (its processes died).
MUST_RESTORE = frozenset({"kill-worker", "kill-node", "preemption"})


@dataclass
class PropertyResult:
    name: str
    ok: bool
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PropertyResult":
        return cls(str(d["name"]), bool(d["ok"]), str(d.get("detail", "")))


def _who(e: dict) -> str:
    return f"node {e.get('node')} rank {e.get('rank')} at t={e.get('time', 0):.3f}"


def _cause(timeline: list[dict], t: float) -> tuple[str, float | None]:
    """The fault kind (or 'failure'/'start') governing an event at time t."""
    fs = [f for f in faults(timeline) if f["time"] <= t and f.get("status") not in NOT_INJECTED]
    if fs:
        return str(fs[-1].get("fault", "failure")), fs[-1]["time"]
    fails = [e for e in timeline if e.get("event") == "failure" and e["time"] <= t]
    if fails:
        return "failure", fails[-1]["time"]
    return "start", None


def _committed_before(timeline: list[dict], t: float | None, tiers: Iterable[str]) -> int | None:
    tiers = set(tiers)
    steps = [e["step"] for e in timeline if e.get("event") == "commit" and tier_of(e) in tiers
             and (t is None or e["time"] <= t) and "step" in e]
    return max(steps) if steps else None


def no_committed_step_lost(timeline: list[dict], surviving_tiers: Mapping[str, Iterable[str]] | None = None) -> PropertyResult:
    tiers_of = {**SURVIVING_TIERS, **{k: tuple(v) for k, v in (surviving_tiers or {}).items()}}
    bad: list[str] = []
    checked = 0
    pending: dict[tuple, float] = {}  # (node, rank) -> run_start awaiting its first step
    for e in timeline:
        ev, node, rank = e.get("event"), e.get("node"), e.get("rank")
        if ev == "restore":
            # A restore by the worker itself or by its node's agent covers it.
            for key in [k for k in pending if k[0] == node and (rank in (-1, None) or k[1] == rank)]:
                del pending[key]
            kind, t_fault = _cause(timeline, e["time"])
            # A resume at start is bound by the durable commits before it.
            c = _committed_before(timeline, t_fault if t_fault is not None else e["time"], tiers_of.get(kind, ("durable",)))
            checked += 1
            step = e.get("step")
            if c is not None and (step is None or step < c):
                bad.append(f"restore to step {step} from tier {e.get('tier')} ({_who(e)}) after {kind}, but step {c} was committed before it at a tier that survives {kind}")
        elif ev == "run_start":
            pending[(node, rank)] = e["time"]
        elif ev == "step" and (node, rank) in pending:
            kind, t_fault = _cause(timeline, pending.pop((node, rank)))
            if t_fault is None:
                continue  # the run's first start: nothing to lose yet
            c = _committed_before(timeline, t_fault, tiers_of.get(kind, ("durable",)))
            checked += 1
            if c is not None and e.get("step", 0) <= c:
                bad.append(f"{_who(e)} restarted after {kind} without a restore and trained step {e.get('step')}, but step {c} was committed")
    if bad:
        return PropertyResult("no_committed_step_lost", False, "; ".join(bad))
    return PropertyResult("no_committed_step_lost", True, f"{checked} restore(s)/restart(s) checked")


def commit_exactly_once(timeline: list[dict], expected: Mapping[str, Iterable[int]] | None = None) -> PropertyResult:
    seen: dict[tuple[str, int], float] = {}
    bad: list[str] = []
    restores = [e for e in timeline if e.get("event") in ("restore", "rollback")]
    n = 0
    for e in timeline:
        if e.get("event") != "commit":
            continue
        n += 1
        key = (tier_of(e), int(e.get("step", -1)))
        if key in seen:
            prev = seen[key]
            redo = [r for r in restores if prev < r["time"] <= e["time"] and r.get("step") is not None and r["step"] < key[1]]
            if not redo:
                bad.append(f"step {key[1]} committed twice at tier {key[0]} (t={prev:.3f} and t={e['time']:.3f}) with no restore to an earlier step between")
        seen[key] = e["time"]
    for tier, steps in (expected or {}).items():
        missing = sorted(s for s in steps if (tier, s) not in seen)
        if missing:
            bad.append(f"tier {tier}: steps {missing} were never committed")
    if bad:
        return PropertyResult("commit_exactly_once", False, "; ".join(bad))
    return PropertyResult("commit_exactly_once", True, f"{n} commit(s), {len(seen)} distinct (tier, step)")


def recovery_within_bounds(eps: list[Episode], bound: timedelta | Mapping[str, timedelta],
                           default: timedelta = timedelta(seconds=60), must_restore: Iterable[str] = MUST_RESTORE) -> PropertyResult:
    must = set(must_restore)
    bad, ok = [], []
    for ep in eps:
        if ep.status in NOT_INJECTED:
            continue
        limit = bound if isinstance(bound, timedelta) else bound.get(ep.fault_id, bound.get(ep.kind, default))
        if ep.restored_at is None:
            if ep.kind in must:
                bad.append(f"{ep.fault_id} ({ep.kind}): never restored")
            continue
        if ep.recovered_at is None:
            bad.append(f"{ep.fault_id} ({ep.kind}): restored at step {ep.restore_step} but never trained a step after")
        elif ep.recovery_seconds > limit.total_seconds():
            bad.append(f"{ep.fault_id} ({ep.kind}): recovery took {ep.recovery_seconds:.1f} s > bound {limit.total_seconds():.1f} s")
        else:
            ok.append(f"{ep.fault_id} {ep.recovery_seconds:.1f} s")
    if bad:
        return PropertyResult("recovery_within_bounds", False, "; ".join(bad))
    return PropertyResult("recovery_within_bounds", True, ", ".join(ok) or "no recovery needed")


def final_state_equal(reference: Any, actual: Any, diff: Callable[[Any, Any], float] | None = None, tolerance: float = 0.0) -> PropertyResult:
    """``reference``/``actual``: parameter digests, or whatever ``diff``
    compares (returning the max absolute difference)."""
    name = "final_state_equal"
    if reference is None or actual is None:
        return PropertyResult(name, False, f"missing final state (reference={reference is not None}, run={actual is not None})")
    if diff is None:
        ok = reference == actual
        return PropertyResult(name, ok, "bitwise equal" if ok else f"digests differ: reference {reference!s:.16} vs run {actual!s:.16}")
    d = float(diff(reference, actual))
    ok = d <= tolerance
    return PropertyResult(name, ok, f"max |Δ| = {d:.3g} {'≤' if ok else '>'} tolerance {tolerance:.3g}")


def training_completed(timeline: list[dict], steps: int) -> PropertyResult:
    reached = max((e.get("step", 0) for e in timeline if e.get("event") in ("step", "run_end")), default=0)
    ok = reached >= steps
    return PropertyResult("training_completed", ok, f"reached step {reached} of {steps}")


# What a straggler verdict must say about each slow fault kind.
SLOW_CAUSES = {"slow-rank": "device", "slow-host": "host", "slow-link": "link"}


def _slow_nodes(timeline: list[dict], f: dict, node_id: Callable[[int], str]) -> list[str] | None:
    """The node ids a slow-host or slow-link fault hit, or None when it hit no rank of the job.
    A slow host's pids are its workers (``workers_started``: after a spare took a seat, seat
    ``node:N`` is another agent than ``nN``); a link is the namespace of agent ``nN`` (or both
    ends of ``link:A-B``), which may be the idle spare, outside the newest round."""
    t0, index = f["time"], str(f.get("target", "")).partition(":")[2]
    before = [e for e in timeline if e["time"] < t0]
    if f["fault"] == "slow-host":
        pids = set(f.get("pids") or [])
        starts = [e for e in before if e.get("event") == "workers_started" and pids & set(e.get("pids") or [])]
        return [starts[-1]["node"]] if starts else None
    rounds = [e for e in before if e.get("event") == "rendezvous" and e.get("nodes")]
    ends = [node_id(int(i)) for i in index.split("-") if i.isdigit()]
    live = set(rounds[-1]["nodes"]) if rounds else set(ends)
    return [n for n in ends if n in live] or None


def _probe_said(p: dict) -> str:
    """One unconfirmed probe, in a line: what was suspected at which step, the compute seconds
    per rank and, for a link, the ring edges' round trips and where a first probe put it."""
    ev = p.get("evidence") or {}
    line = f"step {p.get('step')} {p.get('suspected')} rank {p.get('slow_rank')} probe {ev.get('probe_compute_seconds')}"
    if p.get("suspected") == "link":
        line += f" edges {ev.get('probe_edge_seconds')} slow {ev.get('slow_edges')}"
        if "unconfirmed_at" in ev:
            line += f", first at {ev['unconfirmed_at']}, second at {(ev.get('second_probe') or {}).get('slow_node')}"
    return line


def stragglers_found(timeline: list[dict], within_steps: int, node_id: Callable[[int], str],
                     workers_per_node: int = 2) -> PropertyResult:
    """See the module doc. ``node_id(i)``: the node id of agent ``i``."""
    bad, ok, idle = [], [], []
    injected = [f for f in faults(timeline) if f.get("fault") in SLOW_CAUSES and f.get("event") == "fault_injected"
                and f.get("status") not in NOT_INJECTED]
    for f in injected:
        kind, target, t0 = f["fault"], str(f.get("target", "")), f["time"]
        index = target.partition(":")[2]
        nodes = _slow_nodes(timeline, f, node_id) if kind != "slow-rank" else []
        if nodes is None:   # the soak's idle spare: nothing of the job was slowed
            idle.append(f"{f.get('fault_id')} ({kind} {target}): a spare")
            continue
        verdicts = [e for e in timeline if e.get("event") == "straggler" and e["time"] >= t0]
        steps = sorted({e["step"] for e in timeline if e.get("event") == "step" and e["time"] >= t0})
        want = SLOW_CAUSES[kind]
        # One worker per node (the soak's layout): the detector's host verdict needs two
        # ranks of the node slow together; a single slow rank is all the evidence shows.
        causes = {want, "device"} if kind == "slow-host" and workers_per_node == 1 else {want}

        def names_it(v: dict) -> bool:
            if v.get("cause") not in causes:
                return False
            if kind == "slow-rank":
                return index.isdigit() and v.get("slow_rank") == int(index)
            return v.get("slow_node") in nodes
        hit = next((v for v in verdicts if names_it(v)), None)
        # A slowdown that made a step outlast the heartbeat timeout ends in a re-form (the node
        # replaced, as a hung one): cut short before the bound, it has no straggler left to name.
        reform = next((e["time"] for e in timeline if e.get("event") == "failure" and e["time"] >= t0), None)
        cut = len([e for e in timeline if e.get("event") == "step" and e.get("rank") == 0 and t0 <= e["time"] < reform]) \
            if reform is not None and (hit is None or hit["time"] > reform) else None
        if cut is not None and cut < within_steps:
            idle.append(f"{f.get('fault_id')} ({kind} {target}): re-formed after {cut} step(s)")
            continue
        if hit is None:
            other = [f"{v.get('cause')} rank {v.get('slow_rank')} node {v.get('slow_node')}" for v in verdicts[:3]]
            # Suspicions the probe did not confirm say why nothing was named (the probe's
            # compute seconds per rank against the factor it needed).
            probes = [_probe_said(p) for p in timeline if p.get("event") == "failslow_probe" and p["time"] >= t0][:3]
            bad.append(f"{f.get('fault_id')} ({kind} {target}): no straggler event named it as {want} "
                       f"in {len(steps)} step(s)" + (f" (got: {'; '.join(other)})" if other else "")
                       + (f" (probes not confirmed: {'; '.join(probes)})" if probes else ""))
            continue
        late = len([s for s in steps if s <= hit["step"]])
        (bad if late > within_steps else ok).append(
            f"{f.get('fault_id')} ({kind} {target}): {want} after {late} step(s)"
            + (f" > bound {within_steps}" if late > within_steps else ""))
    tail = [f"not judged (no rank of the job slowed: a spare; or the job re-formed first): {', '.join(idle)}"] if idle else []
    if bad:
        return PropertyResult("stragglers_found", False, "; ".join(bad + tail))
    return PropertyResult("stragglers_found", True, "; ".join(ok + tail) or "no slow fault injected")


def no_leaks(run_dir: str | os.PathLike, *, shm_prefix: str | None = None, shm_paths: Iterable[str] = (), ports: Iterable[int] = (), mounts: Iterable[str | os.PathLike] = (),
             labs: Iterable[Any] = (), exclude_pids: Iterable[int] = (), shm_dir: str = "/dev/shm",
             found: Iterable[str] = ()) -> PropertyResult:
    """Leftovers of a finished run; ``labs`` are :class:`~.netns.NetLab`s;
    ``shm_paths`` are /dev/shm entries the run's processes were seen using
    (the runner samples them: a prefix alone cannot tell the job's segments
    from another job's on a shared machine); ``found`` are leftovers the
    runner saw (and removed) itself, e.g. workers that outlived their agent."""
    needle = str(Path(run_dir).resolve())
    # The runner and its ancestors (a shell, CI) name the run dir in their
    # command lines too; they are not leaks.
    skip = {os.getpid(), *exclude_pids, *(p.pid for p in psutil.Process().parents())}
    left = list(found)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if p.info["pid"] not in skip and (needle in cmd or str(run_dir) in cmd):
            left.append(f"process {p.info['pid']} ({cmd[:80]})")
    if shm_prefix:
        try:
            left += [f"{shm_dir}/{n}" for n in os.listdir(shm_dir) if n.startswith(shm_prefix)]
        except FileNotFoundError:
            pass
    left += [f"{p} (shm)" for p in sorted(set(shm_paths)) if os.path.exists(p)]
    ports = set(ports)
    if ports:
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
                left.append(f"port {c.laddr.port} listening (pid {c.pid})")
    left += [f"mount {m}" for m in mounts if os.path.ismount(m)]
    for lab in labs:
        left += [f"netns/link {x}" for x in lab.leftovers()]
    if left:
        return PropertyResult("no_leaks", False, "; ".join(left))
    return PropertyResult("no_leaks", True, "no processes, shm entries, ports, mounts or namespaces left")


def durable_versions_whole(url: str) -> PropertyResult:
    """Every version the durable tier shows as complete reads back whole:
    every object there, every chunk's checksum right (``resilient ckpt
    verify``). A storage fault (a torn or refused write, a full disk) may
    cost a version, never leave a damaged one looking complete."""
    from resilient.snapshot import SnapshotReader
    from resilient.snapshot.api import SnapshotError
    from resilient_tools.verify import verify

    try:
        steps = SnapshotReader(url).complete_steps()
    except (OSError, SnapshotError) as e:
        return PropertyResult("durable_versions_whole", False, f"cannot list {url}: {type(e).__name__}: {e}")
    if not steps:
        return PropertyResult("durable_versions_whole", False, f"no complete durable version in {url}")
    bad = []
    for step in steps:
        r = verify(f"{url}@{step}", progress=False)
        if not r.ok:
            bad.append(f"step {step}: {r.problems[0].object}: {r.problems[0].problem}")
    if bad:
        return PropertyResult("durable_versions_whole", False, f"{len(bad)} of {len(steps)} complete versions damaged: " + "; ".join(bad[:5]))
    return PropertyResult("durable_versions_whole", True, f"{len(steps)} complete versions verified (steps {steps[0]}..{steps[-1]})")


def check_timeline(timeline: list[dict], eps: list[Episode], *, surviving_tiers: Mapping[str, Iterable[str]] | None = None,
                   bound: timedelta | Mapping[str, timedelta] = timedelta(seconds=60), steps: int | None = None) -> list[PropertyResult]:
    """The properties that need only the timeline (what ``report`` can
    recompute for a run directory without results.json)."""
    out = [no_committed_step_lost(timeline, surviving_tiers), commit_exactly_once(timeline), recovery_within_bounds(eps, bound)]
    if steps is not None:
        out.append(training_completed(timeline, steps))
    return out
