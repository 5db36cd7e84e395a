"""Shared pieces of the benchmarks: statistics, alternation, synthetic state,
training jobs as subprocesses, event reading, and the row/figure records.

Why one module: every row must be measured the same way (ours and the anchor
alternating in one run, several repeats, median + spread + ratio), so the
timing, the statistics and the job handling live here once; a job is run as the
tests and the chaos harness run theirs (``resilient_chaos.launched``). Bench
modules may import from ``resilient``, ``resilient_chaos`` and this module only
(not from ``tests/``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from resilient.observe.plots import pyplot
from resilient_chaos.launched import LaunchedNode, launch_argv, run_events
from resilient_chaos.launched import wait_for as _wait_for

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
DEMO = REPO / "configs" / "demo.toml"
GB = 1 << 30
MB = 1 << 20


# ---------------------------------------------------------------- statistics
def fig(values: list[float], unit: str, label: str = "", digits: int = 4) -> dict:
    """One figure: median, min, max and n of ``values`` (plus the raw values)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "unit": unit, "label": label, "values": []}
    r = lambda x: round(x, digits)  # noqa: E731
    return {"median": r(statistics.median(vals)), "min": r(min(vals)), "max": r(max(vals)), "n": len(vals),
            "unit": unit, "label": label, "values": [r(v) for v in vals]}


def ratio(num: dict, den: dict, label: str, better: str = "lower") -> dict:
    """``num / den`` of two figures' medians; ``better`` says which way is good for ``num``."""
    a, b = num.get("median"), den.get("median")
    value = round(a / b, 3) if a is not None and b else None
    return {"value": value, "label": label, "better": better}


def goal(text: str, met: bool | None, detail: str) -> dict:
    """A row's goal from its issue: ``met`` True/False, or None when it cannot be judged yet."""
    return {"text": text, "met": met, "detail": detail}


def row(title: str, figures: dict, ratios: dict | None = None, goals: list[dict] | None = None,
        notes: list[str] | None = None, status: str = "measured", plots: list[dict] | None = None) -> dict:
    """What a bench module's ``run()`` returns (run.py adds command, date and host)."""
    return {"title": title, "status": status, "figures": figures, "ratios": ratios or {},
            "goals": goals or [], "notes": notes or [], "plots": plots or []}


def pending(title: str, why: str, goals: list[dict] | None = None) -> dict:
    """A row that cannot be measured yet (its feature has not landed)."""
    return row(title, {}, goals=goals, notes=[why], status="pending")


def alternate(trials: dict[str, Callable[[], Any]], repeats: int, warmup: bool = True) -> dict[str, list]:
    """Run every trial once per round, round after round, so that load from the
    other engineers on this machine hits all of them alike. A warm-up round is
    discarded. Each trial returns a float (seconds) or a dict of floats."""
    out: dict[str, list] = {k: [] for k in trials}
    for i in range(repeats + (1 if warmup else 0)):
        for name, fn in trials.items():
            v = fn()
            if warmup and i == 0:
                continue
            out[name].append(v)
    return out


class Timer:
    """``with Timer() as t: ...`` then ``t.s``: wall seconds (perf_counter)."""

    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.t0


# ------------------------------------------------------------ synthetic state
def make_state(nbytes: int, tensor_mb: int = 32, seed: int = 0, meta: bool = False) -> dict:
    """About ``nbytes`` of fp32 tensors, model-like (many tensors of ``tensor_mb``);
    ``meta``: shapes only, no data."""
    import torch

    g = torch.Generator().manual_seed(seed)
    numel = tensor_mb * MB // 4
    n = max(1, round(nbytes / (tensor_mb * MB)))
    if meta:
        return {f"layers.{i}.weight": torch.empty(numel, device="meta") for i in range(n)}
    return {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n)}


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_dir(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------- training jobs
def corpus_path() -> Path:
    """The demo's corpus, built once (from the stdlib's sources, nothing downloaded)."""
    from resilient.gpt.data import prepare

    path = Path("~/.cache/resilient/data/python-stdlib").expanduser()
    if not (path / "meta.json").exists():
        prepare("python-stdlib", path)
    return path


def tiny_sets(steps: int = 100000, **extra: Any) -> list[str]:
    """configs/demo.toml shrunk so a step takes tens of ms: recovery, not compute, is measured."""
    sets = {"model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.max_seq_len": 32,
            "train.seq_len": 32, "train.global_batch": 8, "train.steps": steps, "train.warmup_steps": 2,
            "train.eval_every": 0, "train.log_every": 1000, "data.path": str(corpus_path()), "data.source": "",
            "launch.heartbeat_timeout": 60.0}
    sets.update(extra)
    return [f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in sets.items()]


def launch_cmd(run_dir: Path, sets: list[str], nproc: int = 2, node: str | None = None, nnodes: int | str = 1,
               endpoint: str | None = None, domain: str | None = None) -> list[str]:
    """``resilient launch`` of the demo; with ``node``/``endpoint`` one simulated node of a
    multi-node job (all nodes share ``run_dir`` and the etcd at ``endpoint``)."""
    return launch_argv(DEMO, run_dir, nproc=nproc, overrides=sets,
                       **({"node_id": node, "nnodes": str(nnodes)} if node is not None else {}),
                       endpoint=endpoint, extra_args=["--domain", domain] if domain else [])


def torchrun_cmd(run_dir: Path, sets: list[str], nproc: int = 2, max_restarts: int = 10, nnodes: int | str = 1,
                 endpoint: str = "127.0.0.1:0") -> list[str]:
    """Plain torchrun restarting our same worker script; writes RUN/config.json as the launcher would.
    With ``nnodes`` > 1, one simulated node: every node gets the same command and ``endpoint``
    (the first one started hosts torch's c10d rendezvous store)."""
    from resilient.gpt.config import load_config

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(DEMO, sets)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "-m", "resilient.gpt.worker", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_server():
    """A real single-member etcd on loopback (context manager; ``.endpoint``) for multi-node jobs."""
    from resilient.etcd.server import EmbeddedEtcd

    return EmbeddedEtcd()


def load_note() -> str:
    """The 1/5/15-minute load averages, for the notes: other engineers share these 2 cores."""
    return "load average " + "/".join(f"{x:.1f}" for x in os.getloadavg())


def shown(cmd: list[str]) -> str:
    """A command as a copy-pasteable line, relative to the repo."""
    import shlex

    return " ".join(shlex.quote(c.replace(str(REPO) + "/", "")) for c in [Path(cmd[0]).name, *cmd[1:]])


class Job(LaunchedNode):
    """A training job (agent or torchrun and its workers) in its own session, so the
    whole process tree is killed on close, whatever happened; its output in
    ``<run dir>[-name].log`` beside the run dir."""

    def __init__(self, cmd: list[str], run_dir: Path, env: dict | None = None, name: str = ""):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        base = run_dir.parent / f"{run_dir.name}{'-' + name if name else ''}"
        # Its own TMPDIR, dropped on close: a launcher killed -9 cleans nothing up (torchrun
        # leaves its /tmp/torchelastic_* log dir behind otherwise).
        self.tmp = base.with_name(base.name + ".tmp")
        self.tmp.mkdir(exist_ok=True)
        super().__init__(cmd, base.with_name(base.name + ".log"),
                         env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(self.tmp), **(env or {})})

    def events(self, kind: str | None = None) -> list[dict]:
        return events(self.run_dir, kind)

    def wait_steps(self, n: int, timeout: float, after: float = 0.0) -> dict:
        """Wait until rank 0 logged ``n`` step events newer than ``after``; return the last."""
        def ready():
            got = [e for e in self.events("step") if e["rank"] == 0 and e["time"] > after]
            if not self.alive():
                raise RuntimeError(f"job exited ({self.proc.returncode}):\n{self.tail()}")
            return got[n - 1] if len(got) >= n else None
        return wait_for(ready, timeout, f"{n} steps in {self.run_dir}")

    def kill_node(self) -> float:
        """kill -9 the launcher (agent or torchrun) and every descendant at once: a whole node
        lost (:meth:`LaunchedNode.kill`). Returns the time of the kill. Its node store stays in
        tmpfs (see ``close``)."""
        return self.kill()

    def close(self) -> None:
        """Kill the job's process tree (``kill_node``) and drop its node store."""
        super().close()
        # A node store killed with its agent stays in tmpfs (by design: it outlives workers).
        from resilient.snapshot.nodestore import job_dir

        for e in self.events("agent_start"):
            if e.get("run_id"):
                store = job_dir("/dev/shm", e["run_id"])
                drop_dir(store)
                with contextlib.suppress(OSError):   # this user's root, if no other run holds a tree there
                    store.parent.rmdir()
        drop_dir(self.tmp)


events = run_events


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """:func:`resilient_chaos.launched.wait_for`, polled finely: rows time what it waits for."""
    return _wait_for(predicate, timeout, what, interval)


def worker_pid(job: Job, local_rank: int, script: str = "resilient.gpt.worker") -> int:
    """The pid of a live worker: from the agent's newest ``workers_started`` event, or
    (torchrun logs no pids) the job's child running ``script`` (a module or a script path as
    given to torchrun) whose LOCAL_RANK matches."""
    import psutil

    started = job.events("workers_started")
    if started:
        return dict(zip(started[-1]["local_ranks"], started[-1]["pids"]))[local_rank]
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if script in p.cmdline() and p.environ().get("LOCAL_RANK") == str(local_rank):
                return p.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no worker with local rank {local_rank} under {job.cmd[:4]}")


def spares_idle(job: Job, want: int, window: float = 0.5) -> bool:
    """Whether ``want`` warm spares of an agent have finished importing (idle on stdin)."""
    import psutil

    started = job.events("workers_started")
    busy = set(started[-1]["pids"]) if started else set()
    procs = []
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if p.pid not in busy and "resilient.agent.warm" in " ".join(p.cmdline()):
                procs.append((p, sum(p.cpu_times()[:2])))
        except psutil.Error:
            continue
    # A warm zygote (the agent's default with spares) forks any number of workers in ~30 ms:
    # one idle zygote stands for every spare.
    zygote = False
    for p, _ in procs:
        try:
            zygote = zygote or "--zygote" in p.cmdline()
        except psutil.Error:
            continue
    if len(procs) < (1 if zygote else want):
        return False
    time.sleep(window)
    try:
        return sum(sum(p.cpu_times()[:2]) == c for p, c in procs) >= (1 if zygote else want)
    except psutil.Error:
        return False


def kill_worker(job: Job, local_rank: int = 1, timeout: float = 600, script: str = "resilient.gpt.worker") -> dict:
    """kill -9 one worker; time from the kill to rank 0's first ``step`` event logged after the
    new workers' ``run_start`` (steps that finished in flight before the failure was noticed
    do not count). Also: which tier served the restore and how many steps were redone."""
    import random

    job.wait_steps(1, timeout)  # training is running
    time.sleep(random.uniform(0, 0.3))  # land at a random point of a step
    pid = worker_pid(job, local_rank, script)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)

    def recovered():
        if not job.alive():
            raise RuntimeError(f"job exited ({job.proc.returncode}):\n{job.tail()}")
        starts = [e for e in job.events("run_start") if e["rank"] == 0 and e["time"] > t_kill]
        if not starts:
            return None
        steps = [e for e in job.events("step") if e["rank"] == 0 and e["time"] > starts[0]["time"]]
        return (starts[0], steps[0]) if steps else None

    start, first = wait_for(recovered, timeout, "the first step after recovery")
    done = [e["step"] for e in job.events("step") if e["rank"] == 0 and e["time"] <= t_kill]
    restores = [e for e in job.events("restore") if e["time"] > t_kill]
    started = [e for e in job.events("workers_started") if e["time"] > t_kill]
    failures = [e for e in job.events("failure") if e["time"] > t_kill]
    return {"recovery_s": first["time"] - t_kill, "run_start_s": start["time"] - t_kill,
            "detected_s": failures[0]["time"] - t_kill if failures else None,
            "respawned_s": started[0]["time"] - t_kill if started else None,
            "restored_step": start["start_step"], "lost_steps": max(done, default=0) - start["start_step"],
            "tier": restores[0]["tier"] if restores else None,
            "restore_s": max((e["seconds"] for e in restores), default=None),
            "warm": started[0].get("warm") if started else None, "last_step_before": max(done, default=0)}


def kill_series(job: Job, kills: int, spares: int = 0, settle_steps: int = 3, jitter_steps: int = 0,
                timeout: float = 600, local_rank: int = 1) -> list[dict]:
    """``kills`` kill/recover cycles on one job. Before each: ``settle_steps`` steps, a durable
    commit newer than the last recovery (so every launcher has something to restore), then
    0..``jitter_steps`` more steps (so kills land anywhere in a snapshot interval), and, for an
    agent with ``spares``, the spares warm again: every kill sees the same state."""
    import random

    out: list[dict] = []
    for _ in range(kills):
        since = out[-1]["t_done"] if out else 0.0
        job.wait_steps(settle_steps, timeout, after=since)
        wait_for(lambda: [e for e in job.events("commit") if e.get("tier") == "durable" and e["time"] > since],
                 timeout, "a durable commit")
        extra = random.randint(0, jitter_steps)
        if extra:
            job.wait_steps(extra, timeout, after=time.time())
        if spares:
            try:  # bounded: an agent that keeps fewer spares warm than asked must not stall the row
                wait_for(lambda: spares_idle(job, spares), min(timeout, 60), "warm spares")
            except TimeoutError:
                pass  # measured anyway; the result's "warm" says how many spares were used
        r = kill_worker(job, local_rank, timeout=timeout)
        r["t_done"] = time.time()
        out.append(r)
    return out


def step_gaps(run_dir: Path, skip: int = 5) -> list[float]:
    """Gaps between rank 0's consecutive step events: the snapshot capture, which
    happens after the step event, is inside the gap."""
    ts = sorted(e["time"] for e in events(run_dir, "step") if e["rank"] == 0)[skip:]
    return [b - a for a, b in zip(ts, ts[1:])]


# --------------------------------------------------------------------- plots
def plot_figures(name: str, result: dict, out_dir: Path) -> list[str]:
    """One bar chart per unit: medians with min–max whiskers. Returns PNG file names."""
    plt = pyplot()
    if plt is None:  # matplotlib not installed: the numbers stand without the picture
        return []

    by_unit: dict[str, list[tuple[str, dict]]] = {}
    for key, f in result.get("figures", {}).items():
        if f.get("median") is not None:
            by_unit.setdefault(f["unit"], []).append((f.get("label") or key, f))
    files = []
    for i, (unit, items) in enumerate(by_unit.items()):
        fig_, ax = plt.subplots(figsize=(max(5, 1.2 * len(items) + 2), 3.6))
        med = [f["median"] for _, f in items]
        err = [[m - f["min"] for m, (_, f) in zip(med, items)], [f["max"] - m for m, (_, f) in zip(med, items)]]
        ax.bar(range(len(items)), med, yerr=err, capsize=4, color="#4878a8")
        ax.set_xticks(range(len(items)), [k for k, _ in items], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{result.get('title', name)} (median, min–max)", fontsize=9)
        fig_.tight_layout()
        fname = f"{name}{'' if i == 0 else f'-{i}'}.png"
        fig_.savefig(out_dir / fname, dpi=90)
        plt.close(fig_)
        files.append(fname)
    return files
