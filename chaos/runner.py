"""``resilient chaos run SCENARIO [--out DIR]`` and ``resilient chaos report DIR``.

A campaign answers one question: *did the job stay correct while things
broke?* Training alone finishing proves little (a job that silently
retrained from scratch, or lost a committed step, also finishes). So the
runner trains the scenario twice, with the same config, seed and layout:

1. ``OUT/reference``: no faults; its final parameters (per-rank digests) and
   loss curve are the oracle;
2. ``OUT/faulted``: the same job under the scenario's faults, fired by
   :class:`~.campaign.FaultDriver` at their step or time;

then judges the faulted run's merged timeline (:func:`~.campaign.evaluate`:
no committed step lost, each step committed once per tier, every recovery
under its bound, final state bitwise equal to the reference — or, after a
resize, losses within the stated tolerance — and nothing leaked), and writes
``OUT/faulted/report.md`` + ``timeline.png``. The exit code is 0 only when
every property holds, every planned step/time fault was really injected, and
the run ended within its budget.

The reference runs first, alone, so the two runs never compete for the
CPUs (a faulted run slowed by its reference would blame recovery bounds on
the harness).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilient.contract import events_path
from resilient.errors import ConfigError
from resilient.snapshot.storeroot import user_root
from resilient.procs import ignore_stop_signals
from resilient.shipped import shipped_config

from .campaign import evaluate
from .infra import Infra
from .injectors import InjectionFailed
from .jobs import END_GRACE, REPO, EtcdService, FinalState, LocalJob, final_state, loss_diff
from .properties import PropertyResult, durable_versions_whole
from .report import kind_summary, report
from .scenario import MAX_SECONDS, PlannedFault, Scenario, load_scenario
from .timeline import episodes, load_timeline

CONTROL_ENV = "RESILIENT_CHAOS_CONTROL"
HOOKS_ENV = "RESILIENT_WORKER_HOOKS"   # resilient.job.api.HOOKS_ENV
WORKER_HOOKS = "resilient_chaos.hooks:WorkerHooks.attach"


def resolve_config(sc: Scenario) -> Path:
    """The training config: absolute, relative to the working directory,
    to the scenario file, or to the repository root (shipped scenarios say
    ``configs/demo.toml``)."""
    p = Path(sc.training.config).expanduser()
    for cand in (p, Path.cwd() / p, Path(sc.source).parent / p, REPO / p, shipped_config(p)):
        if cand is not None and cand.is_file():
            return cand.resolve()
    raise ConfigError(f"{sc.source}: training.config {sc.training.config!r} not found (relative to the working directory, the scenario or {REPO})")


class RunOutcome:
    """How one run (reference or faulted) ended, and what it left behind."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.how = "not started"
        self.error = ""
        self.seconds = 0.0
        self.final: FinalState | None = None
        self.exit_codes: dict[str, int | None] = {}
        self.launched_at: dict[str, float] = {}
        self.agent_pids: dict[int, str] = {}
        self.ports: list[int] = []
        self.shm: list[str] = []
        self.shm_prefix: str | None = None
        self.shm_dir = "/dev/shm"
        self.records: list = []
        self.orphans: list[str] = []
        self.pacing: list[dict] = []

    def to_dict(self) -> dict:
        return {"run_dir": str(self.run_dir), "how": self.how, "seconds": round(self.seconds, 2), "exit_codes": self.exit_codes,
                "final": self.final.to_dict() if self.final else None}


class _NoEtcd:
    """The runner's etcd when the agents run their own (topology.etcd = "embedded")."""

    members: list = []
    ports: list[int] = []
    endpoints: list[str] = []


def _run_job(sc: Scenario, run_dir: Path, overrides: list[str], *, spares: int, plan: list[PlannedFault] | None,
             infra: Infra | None, budget: timedelta) -> RunOutcome:
    """Start etcd and the agents, fire ``plan`` (if any), wait for the end
    or the budget, and tear everything down whatever happens."""
    from .campaign import FaultDriver, Pace

    out = RunOutcome(run_dir)
    host = infra.netlab.host_address if infra is not None and infra.netlab is not None else "127.0.0.1"
    members = sc.topology.etcd_members if plan is not None else 1
    t0 = time.monotonic()
    driver: FaultDriver | None = None
    embedded = sc.topology.etcd == "embedded"
    # topology.etcd = "embedded": no etcd of the runner; the agents run their own (no --rdzv-endpoint).
    with (contextlib.nullcontext(_NoEtcd()) if embedded else EtcdService(members, host=host)) as etcd:
        if any(f.kind == "embedded-etcd-kill" for f in plan or ()):
            for m in etcd.members:  # as resilient launch watches the etcd it embeds
                m.watch()
        out.ports = etcd.ports
        endpoints = etcd.endpoints
        proxies: dict = {}
        if infra is not None:
            for name in sc.topology.proxy:  # "etcd" or "rendezvous": both are the etcd the agents rendezvous through
                upstream = etcd.members[0]
                p = infra.proxy(name, (upstream.host, upstream.client_port), host=host)
                endpoints = [f"{p.address[0]}:{p.address[1]}", *endpoints[1:]]
            proxies = infra.proxies
        # The workers' Job loads the hooks through its public extension point (RESILIENT_WORKER_HOOKS).
        env = {CONTROL_ENV: str(infra.control_dir), HOOKS_ENV: WORKER_HOOKS} if infra is not None else {}
        job = LocalJob(sc, run_dir, resolve_config(sc), overrides, ",".join(endpoints), spares=spares,
                       netlab=infra.netlab if infra else None, proxies=proxies,
                       durable_path=infra.durable_path if infra else None,
                       control_dir=infra.control_dir if infra else None, etcd_members=etcd.members, env=env)
        try:
            with job:
                try:
                    job.start()
                    if plan is not None:
                        pace = Pace(sc.topology.nodes, sc.pace_steps, timedelta(seconds=sc.pace_timeout_seconds))
                        driver = FaultDriver(plan, job, pace=pace).start()
                    # A run that need not complete (a soak) ends with its last fault.
                    until = driver.done if driver is not None and not sc.properties.training_completes else None
                    out.how = job.wait(budget - timedelta(seconds=time.monotonic() - t0), until=until)
                except InjectionFailed as e:  # the job could not even form: judged, not crashed
                    out.how, out.error = "error", str(e)
                finally:
                    # Faults are cleared (SIGCONT, etcd restarted, disk freed)
                    # while the job still runs, so a node it stops next gets
                    # to clean up, and nothing stays stopped behind it.
                    if driver is not None:
                        out.records = driver.stop()
                        out.pacing = driver.pacing
                out.exit_codes = job.exit_codes()
                out.launched_at = {job.node_id(n): t for n, t in job.launched_at.items()}
                out.agent_pids = dict(job.agent_pids)
        finally:
            out.shm_prefix, out.shm_dir = job.shm_prefix, str(user_root(job.store_dir))
            out.shm = [p for p in job.all_shm() if not Path(p).name.startswith(job.shm_prefix)]
            out.orphans = list(job.orphans)
    out.seconds = time.monotonic() - t0
    out.final = final_state(run_dir)
    return out


def _faults_fired(plan: list[PlannedFault], records: list) -> PropertyResult:
    """Every fault planned at a step or a time was really injected. A rate
    fault whose turn came after the run ended is not a failure (the plan
    covers the whole budget); one that fired and failed is."""
    fired = {r.fault_id for r in records}
    scheduled = [f for f in plan if f.at_step is not None or "." not in f.fault_id]  # rate faults are f<i>.<n>
    missing = [f.describe() for f in scheduled if f.fault_id not in fired]
    failed = [f"{r.fault_id} ({r.kind}): {r.detail}" for r in records if r.status == "failed"]
    skipped = [f"{r.fault_id} ({r.kind}): {r.detail}" for r in records if r.status == "skipped"]
    bad = [f"never fired: {m}" for m in missing] + [f"failed: {f}" for f in failed]
    if bad:
        return PropertyResult("faults_injected", False, "; ".join(bad))
    injected = sum(1 for r in records if r.status in ("injected", "cleared"))
    return PropertyResult("faults_injected", True, f"{injected} injected" + (f", {len(skipped)} skipped: " + "; ".join(skipped) if skipped else ""))


def _paced_recovered(pacing: list[dict]) -> PropertyResult:
    """Every paced fault was followed by a recovery to full strength (every
    seat filled, steps made) before the next one fired."""
    late = [f"{r['fault_id']} ({r['kind']}): {r['not_ready']}" for r in pacing if "not_ready" in r]
    ready = [r["ready_seconds"] for r in pacing if "ready_seconds" in r]
    if late:
        return PropertyResult("paced_recovered", False, f"{len(late)} of {len(pacing)} paced faults not recovered: " + "; ".join(late[:10]))
    return PropertyResult("paced_recovered", True, f"{len(ready)} of {len(pacing)} paced faults followed by full strength"
                          + (f" (max {max(ready):.1f} s after injection)" if ready else "")
                          + ("; the last one was cut short by the budget" if len(ready) < len(pacing) else ""))


# Faults after which a node's agent is expected to die or leave with a non-zero code.
NODE_ENDING = frozenset({"kill-node", "preemption", "scale-down"})


def _job_ended(outcome: RunOutcome, sc: Scenario) -> PropertyResult:
    """The job ended by itself within the budget and every agent exited 0,
    except those a node-ending fault hit after their last start (a soak
    without a last step may instead run into its budget)."""
    hit: dict[str, float] = {}
    for r in outcome.records:
        if r.kind in NODE_ENDING and r.status in ("injected", "cleared"):
            # node:N is a seat, not an agent: the agents hit are those whose pid the injector signalled.
            for pid in r.pids:
                if pid in outcome.agent_pids:
                    hit[outcome.agent_pids[pid]] = max(hit.get(outcome.agent_pids[pid], 0.0), r.injected_at or 0.0)
            if r.kind == "scale-down" and r.target[5:].isdigit():  # scale faults name agents
                hit[f"n{r.target[5:]}"] = r.injected_at or 0.0
    codes = {n: c for n, c in outcome.exit_codes.items() if not (n in hit and hit[n] >= outcome.launched_at.get(n, 0.0))}
    late = _failures_after_end(outcome.run_dir)
    clean = outcome.how == "finished" and all(c == 0 for c in codes.values()) and not late
    ok = clean or (outcome.how in ("budget", "faults done") and not sc.properties.training_completes)
    what = {"finished": "finished", "hung": f"training finished but agents were still running {END_GRACE.total_seconds():.0f} s later (killed)",
            "exited": "every agent exited before training finished", "budget": "ran out of its budget (killed)",
            "faults done": "every fault fired and the job recovered from the last (stopped)",
            "error": f"could not run: {outcome.error}"}.get(outcome.how, outcome.how)
    return PropertyResult("job_ended", ok, (f"after training finished: {'; '.join(late)}; " if late else "") +
                          f"{what}; {outcome.seconds:.1f} s of {sc.budget_seconds:.0f} s budget; "
                          f"agent exit codes {outcome.exit_codes}" + (f" (ended by faults: {sorted(hit)})" if hit else ""))


def _failures_after_end(run_dir: Path) -> list[str]:
    """Failures the runtime itself saw after every rank wrote its final
    run_end (a worker that hangs or dies on its way out)."""
    from resilient.events import read_events

    path = events_path(run_dir)
    evs = list(read_events(path)) if path.exists() else []
    world, done, t_end = 0, set(), None
    for e in evs:  # the moment every rank of the layout had first finished
        if e.get("event") == "run_start":
            world = int(e.get("layout", {}).get("world", 0))
        elif e.get("event") == "run_end" and "param_digest" in e:
            done.add(e.get("rank"))
            if world and len(done) >= world:
                t_end = e["time"]
                break
    if t_end is None:
        return []
    return [f"{e['event']} {e.get('kind', '')} on node {e.get('node')} (local rank {e.get('local_rank')}, pid {e.get('pid')}) "
            f"{e['time'] - t_end:+.1f} s after run_end".replace("  ", " ")
            for e in evs if e.get("event") in ("failure", "heartbeat_timeout", "worker_error") and e["time"] > t_end]


def run_campaign(scenario: str | Path, out: str | Path | None = None, *, log=print, budget: timedelta | None = None) -> int:
    """Run one scenario end to end; return the exit code (0 = every property
    holds). ``budget`` replaces the scenario's (a scaled soak)."""
    sc = load_scenario(scenario)
    if budget is not None:
        sc.budget_seconds = _checked_budget(budget.total_seconds())
    plan = sc.plan()  # every check of the scenario before anything is created
    out = Path(out or Path("runs") / "chaos" / f"{sc.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    ref_dir, run_dir = out / "reference", out / "faulted"
    for d in (ref_dir, run_dir):
        if d.exists() and not d.is_dir():
            raise ConfigError(f"{d} is a file: give a fresh --out directory")
        if d.exists() and any(d.iterdir()):
            raise ConfigError(f"{d} is not empty: give a fresh --out (a campaign judges the logs it finds there)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot use --out {out}: {e.strerror or e}; give a directory that can be created") from None
    log(f"chaos: {sc.name}: {len(plan)} fault(s) planned; output in {out}")
    for f in plan[:20]:
        log(f"  {f.describe()}")

    reference: RunOutcome | None = None
    if sc.training.reference and sc.properties.final_state != "skip":
        log("chaos: reference run (no faults)...")
        # No warm spare workers: nothing fails, and on a small machine their
        # torch imports would only slow the reference down.
        reference = _run_job(sc, ref_dir, [*sc.training.overrides, "launch.spares=0"], spares=0, plan=None, infra=None, budget=sc.budget)
        log(f"chaos: reference {reference.how} in {reference.seconds:.1f} s")

    log("chaos: faulted run...")
    with Infra(sc, run_dir) as infra:
        faulted = _run_job(sc, run_dir, infra.launch_overrides(), spares=sc.topology.spares, plan=plan, infra=infra, budget=sc.budget)
        leaks: dict[str, Any] = infra.leak_kwargs()
        unavailable = dict(infra.unavailable)
        storage_props = []
        if {f.kind for f in sc.faults} & {"storage-flaky", "disk-full"}:
            # Judged before the small volume is unmounted.
            storage_props.append(durable_versions_whole(infra.durable_plain_url()))
    log(f"chaos: faulted run {faulted.how} in {faulted.seconds:.1f} s")

    leaks["ports"] = [*leaks.get("ports", []), *faulted.ports, *(reference.ports if reference else [])]
    leaks["shm_paths"] = [*faulted.shm, *(reference.shm if reference else [])]
    leaks["shm_prefix"], leaks["shm_dir"] = faulted.shm_prefix, faulted.shm_dir
    leaks["found"] = faulted.orphans
    extra_props = [_faults_fired(plan, faulted.records), _job_ended(faulted, sc), *storage_props]
    if any(f.paced for f in plan):
        extra_props.append(_paced_recovered(faulted.pacing))
    if reference is not None:
        # The oracle only needs the reference's final state; how it exited is
        # shown (a runtime that hangs on exit without faults is worth knowing).
        late = _failures_after_end(ref_dir)
        detail = (f"final state of {reference.final.layout_key}, {len(reference.final.losses)} steps; " if reference.final else
                  f"did not finish, no final state; see {ref_dir / 'logs'}; ") + f"{reference.how} after {reference.seconds:.1f} s"
        extra_props.append(PropertyResult("reference_run", reference.final is not None,
                                          detail + (f"; after training finished: {'; '.join(late)}" if late else "")))
    ref_val, act_val, diff = _final_values(sc, reference, faulted)
    evaluate(sc, run_dir, faulted.records, reference=ref_val, actual=act_val, diff=diff, leaks=leaks, more=extra_props,
             extra={"runs": {"reference": reference.to_dict() if reference else None, "faulted": faulted.to_dict()},
                    "unavailable": unavailable, "output": str(out),
                    "per_kind": kind_summary(episodes(load_timeline(run_dir)), faulted.records, faulted.pacing),
                    "pacing": faulted.pacing})
    _remove_stores(faulted, reference)
    code = report(run_dir)
    log(f"chaos: {'PASS' if code == 0 else 'FAIL'} — {run_dir / 'report.md'}")
    return code


def _remove_stores(*outcomes: RunOutcome | None) -> None:
    """After judging: delete node stores a killed job left in /dev/shm (the
    leak check has reported them), so a failed campaign does not eat the
    machine's shared memory."""
    import shutil

    for o in outcomes:
        if o is not None and o.shm_prefix:
            for p in Path(o.shm_dir).glob(o.shm_prefix + "*"):
                shutil.rmtree(p, ignore_errors=True)


def _final_values(sc: Scenario, reference: RunOutcome | None, faulted: RunOutcome) -> tuple[Any, Any, Any]:
    """What :func:`~.properties.final_state_equal` compares. 'bitwise' needs
    the same layout at the end (digests of different shardings are not
    comparable; a resize needs final_state = 'tolerance', which compares the
    loss curves); the digest strings carry the layout, so a changed layout
    fails with both layouts named."""
    ref = reference.final if reference else None
    act = faulted.final
    if sc.properties.final_state == "tolerance":
        return ref, act, loss_diff
    return (ref.digest if ref else None), (act.digest if act else None), None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="resilient chaos", description="Chaos campaigns: inject faults into a training job and check it stays correct.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run a scenario (reference + faulted run), write the report; exit 0 iff every property holds")
    run.add_argument("scenario", help="scenario TOML, or the name of a shipped one (kill-worker, kill-node, ci-mixed, ...)")
    run.add_argument("--out", default=None, help="output directory (default: runs/chaos/NAME-TIMESTAMP, git-ignored)")
    run.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                     help="replace the scenario's budget_seconds (e.g. a soak scaled to the time at hand)")
    rep = sub.add_parser("report", help="(re)write report.md and timeline.png of a run directory; exit 0 iff every property held")
    rep.add_argument("dir", help="OUT (of chaos run) or OUT/faulted")
    args = ap.parse_args(argv)
    # SIGTERM (a CI timeout, a Ctrl-C of a parent) must unwind through the
    # context managers, which kill the agents and etcd and unmount what was
    # mounted; Python's default would end the process on the spot.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        if args.cmd == "run":
            return run_campaign(args.scenario, args.out,
                                budget=None if args.budget is None else timedelta(seconds=_checked_budget(args.budget)))
        d = Path(args.dir)
        if (d / "reference").is_dir() and not (d / "faulted").is_dir():
            raise ConfigError(f"{d} holds only the reference run: the campaign was interrupted before its faulted run")
        if (d / "faulted").is_dir():
            d = d / "faulted"
        if not d.is_dir():
            raise ConfigError(f"{args.dir} is not a chaos run directory")
        code = report(d)
        print(f"chaos: {'PASS' if code == 0 else 'FAIL'} — {d / 'report.md'}")
        return code
    except ConfigError as e:
        print(f"resilient chaos: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("resilient chaos: interrupted; everything the campaign started was stopped", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _checked_budget(seconds: float) -> float:
    if not 0 < seconds <= MAX_SECONDS:  # NaN-safe; checked before a timedelta is made of it
        raise ConfigError(f"--budget must be > 0 and ≤ {MAX_SECONDS:g} seconds (got {seconds})")
    return seconds


def _raise_interrupt(signum, frame) -> None:
    # The first signal unwinds; the teardown it starts (agents get STOP_GRACE to leave,
    # then are killed; etcd stopped; mounts undone) must not be cut short by a second
    # one, which left agents running against a stopped etcd.
    ignore_stop_signals()
    print("resilient chaos: stopping the job (up to 30 s; further signals are ignored)...", file=sys.stderr)
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
