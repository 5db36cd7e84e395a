"""Control-plane simulator: N simulated nodes against a real etcd (issue #25).

    python bench/scale.py --nodes 8,32,128 [--rdzv-endpoint HOST:PORT,...] [--members 1|3]
                          [--versions V] [--procs P] [--out DIR]

Each node runs the agent's real control plane (bench/scale_node.py: the etcd3 rendezvous
handler and backend, liveness leases, the node registry, the quarantine check, a node
store with its authenticated peer server and the real replicator committing tiny
versions) and nothing else; nodes are threads spread over ``--procs`` processes, so the
GIL of one process is not what is measured (compare ``--procs 1``: the simulator prints
its processes' and etcd's CPU seconds per phase, which tell the two apart).

Per N it measures: the first round (all N join), the re-form after one node is killed and
after 10% are killed at once (from the kill until every survivor has joined the new
round; the agent's detection interval is not included), etcd requests, writes and bytes
per round and per committed version (from etcd's own ``/metrics``), commit latency,
keep-alive requests per second while idle, and etcd database growth per 1,000 versions
(history compacted). It writes ``scale.json`` and ``scale.png`` under ``--out`` and
prints a RESULTS.md row.

Against your own etcd (``--rdzv-endpoint``, the metrics of its first endpoint are read;
its ``/metrics`` must be reachable there): this is what to run before a big job; the
simulator uses its own run ids and deletes its keys at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_etcd import delta, requests, scrape, writes  # noqa: E402

from resilient.etcd.cluster import EtcdCluster  # noqa: E402
from scale_node import fleet_main  # noqa: E402

from resilient.etcd.client import EtcdClient  # noqa: E402
from resilient_chaos.etcd_testing import unique_run_id  # noqa: E402
from resilient.observe.plots import pyplot  # noqa: E402
from resilient.snapshot.commits import REPLICATED, commit_key  # noqa: E402


class Fleet:
    """The simulator processes of one N: commands go to every process at once; the
    answers are the per-node results of all of them."""

    def __init__(self, n: int, procs: int, cfg: dict[str, Any], domains: int) -> None:
        ctx = mp.get_context("spawn")
        self.names = [f"n{i:04d}" for i in range(n)]
        cfg = {**cfg, "names": self.names}  # the members every node checks for losses
        self.where: dict[str, int] = {}
        self.pipes, self.procs = [], []
        try:
            for p in range(min(procs, n)):
                mine = self.names[p::procs]
                for name in mine:
                    self.where[name] = p
                parent, child = ctx.Pipe()
                doms = [f"d{int(name[1:]) * domains // n:03d}" for name in mine]
                proc = ctx.Process(target=fleet_main, args=(child, mine, doms, cfg), daemon=True)
                proc.start()
                self.pipes.append(parent)
                self.procs.append(proc)
            ready = self._collect()
        except BaseException:
            self.close()
            raise
        bad = [r for r in ready if "error" in r]
        if bad:
            self.close()
            raise RuntimeError(f"{len(bad)} simulated nodes failed to start; first: {bad[0]['error']}\n"
                               f"{bad[0].get('trace', '')}")

    def _collect(self, timeout: timedelta = timedelta(seconds=900)) -> list:
        out: list = []
        for pipe in self.pipes:
            if not pipe.poll(timeout.total_seconds()):
                raise TimeoutError(f"a simulator process did not answer within {timeout}")
            _, got = pipe.recv()
            out += got if isinstance(got, list) else [got]
        return out

    def all(self, cmd: str, arg: Any = None) -> list:
        for pipe in self.pipes:
            pipe.send((cmd, arg))
        return self._collect()

    def kill(self, names: list[str]) -> None:
        by_proc: dict[int, list[str]] = {}
        for n in names:
            by_proc.setdefault(self.where[n], []).append(n)
        for p, mine in by_proc.items():
            self.pipes[p].send(("kill", mine))
        for p in by_proc:
            self.pipes[p].recv()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid]

    def close(self, kill: bool = False) -> None:
        """Close every node and stop the processes; ``kill`` (after a failure or an interrupt,
        when a process may be stuck in a command) kills them at once instead."""
        for pipe in self.pipes:
            try:
                pipe.send(("close", None))
            except (OSError, ValueError):
                pass
        for proc, pipe in zip(self.procs, self.pipes):
            try:
                if not kill and pipe.poll(60):
                    pipe.recv()
            except (OSError, EOFError):
                pass
            proc.join(0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class Meter:
    """etcd's counters and CPU seconds (simulator processes, etcd) between two points."""

    def __init__(self, metrics_url: str, sim_pids: list[int], etcd_pids: list[int]) -> None:
        self.url = metrics_url
        self.sim = [psutil.Process(p) for p in sim_pids]
        self.etcd = [psutil.Process(p) for p in etcd_pids]

    @staticmethod
    def _cpu(ps: list[psutil.Process]) -> float:
        total = 0.0
        for p in ps:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def mark(self) -> dict:
        return {"m": scrape(self.url), "t": time.monotonic(), "sim": self._cpu(self.sim), "etcd": self._cpu(self.etcd)}

    def since(self, a: dict) -> dict:
        b = self.mark()
        d = delta(b["m"], a["m"])
        wall = b["t"] - a["t"]
        return {"wall_s": round(wall, 3), "writes": writes(d), "requests": requests(d), "txn": d.get("txn", 0),
                "range": d.get("range", 0), "keepalives": d.get("grpc.LeaseKeepAlive", 0),
                "rx_bytes": d.get("rx_bytes", 0), "tx_bytes": d.get("tx_bytes", 0),
                "sim_cpu_s": round(b["sim"] - a["sim"], 2), "etcd_cpu_s": round(b["etcd"] - a["etcd"], 2),
                "sim_busy": round((b["sim"] - a["sim"]) / max(wall, 1e-9) / max(1, len(self.sim)), 2)}


def _round(results: list[dict], since: float, what: str) -> dict:
    errors = [r for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    rounds = {r["round"] for r in ok}
    worlds = {r["world"] for r in ok}
    ranks = sorted(r["rank"] for r in ok)
    return {"what": what, "seconds": round(max((r["t1"] for r in ok), default=since) - since, 3),
            # of which the rendezvous (the rest: the round's node ids exchanged through its store)
            "rendezvous_s": round(max((r["t_rdzv"] for r in ok), default=since) - since, 3),
            "joins_max": max((r.get("joins", 1) for r in ok), default=0),
            "joined": len(ok), "errors": len(errors), "first_error": errors[0]["error"] if errors else None,
            "rounds": sorted(rounds), "worlds": sorted(worlds),
            "ranks_unique": len(ranks) == len(set(ranks)) and ranks == list(range(len(ranks)))}


def _line(text: str) -> None:
    sys.stderr.write(f"\r\033[K{text}")
    sys.stderr.flush()


def simulate(n: int, endpoint: str, metrics_url: str, etcd_pids: list[int], args) -> dict:
    """One fleet of ``n`` nodes through every phase; the measured figures."""
    run_id = unique_run_id(f"scale{n}")
    lost10 = math.ceil(n * args.lost_fraction)  # 0: no mass-loss phase
    shm = tempfile.mkdtemp(prefix="resilient-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    # torch's handler: the re-forming survivors must all join within the last call (~30 writes/s
    # of its one state key), or the stragglers wait and force another round; the keyed one's joins
    # do not queue.
    last_call = args.last_call or (1.0 if args.handler == "keys" else max(1.0, 0.02 * n))
    conf = {"lease_ttl": str(args.lease_ttl), "last_call_timeout": str(last_call),
            "join_timeout": str(args.join_timeout), "keep_alive_interval": str(args.keep_alive),
            "poll_interval": str(args.poll), "store_timeout": "120", "handler": args.handler}
    cfg = {"endpoint": endpoint, "run_id": run_id, "min_nodes": n, "max_nodes": n,
           "conf": conf, "shm": shm, "k": args.k, "secret": secrets.token_hex(32), "protocol": args.commit,
           "gather_timeout": args.gather_timeout}
    out: dict[str, Any] = {"nodes": n, "run_id": run_id, "procs": min(args.procs, n), "k": args.k,
                           "handler": args.handler,
                           "commit_protocol": args.commit,
                           "min_nodes_reform": max(1, n - 1 - lost10), "max_nodes": n, "conf": conf}
    client = EtcdClient(endpoint, retry_timeout=timedelta(seconds=30))
    fleet, failed = None, True
    try:
        _line(f"N={n}: starting {n} simulated nodes in {out['procs']} processes")
        t = time.monotonic()
        fleet = Fleet(n, args.procs, cfg, args.domains)
        out["start_s"] = round(time.monotonic() - t, 2)
        meter = Meter(metrics_url, fleet.pids(), etcd_pids)

        _line(f"N={n}: first round")
        m, t0 = meter.mark(), time.time()
        out["first_round"] = {**_round(fleet.all("join"), t0, "first"), **meter.since(m)}

        # Each agent's first full node-loss check reads the whole registry, once in its life
        # (later ones read what changed), at its own phase of the first max(10, N/8) checks:
        # done here beforehand, spread over a few seconds, so that the idle figures are the
        # steady state's.
        _line(f"N={n}: each node's first whole read of the registry (not measured)")
        fleet.all("prime", max(2.0, n / 64))
        _line(f"N={n}: idle {args.idle:.0f} s (keep-alives, node-loss checks, waiting-node asks)")
        m = meter.mark()
        # What every agent does while training: lease keep-alives (threads) and, every third of
        # the node lease's TTL, a check for lost nodes (its ring neighbours; all every 10th).
        fleet.all("idle", (args.idle, args.lease_ttl / 3))
        idle = meter.since(m)
        out["idle"] = {**idle, "keepalives_per_s": round(idle["keepalives"] / idle["wall_s"], 1),
                       "requests_per_s": round(idle["requests"] / idle["wall_s"], 1),
                       "etcd_out_bytes_per_s": round(idle["tx_bytes"] / idle["wall_s"]),
                       "writes_per_s": round(idle["writes"] / idle["wall_s"], 1)}

        # From here on torch's rendezvous heartbeats stop writing (their load was measured
        # idle, above): the versions' writes are the commit protocol's alone, and the
        # re-forms' are the rounds' (the dead are evicted on proof, as the agent does).
        # Not restored: the sanitizer would then drop every node whose heartbeat is older
        # than 3 intervals at once.
        fleet.all("settings", {"keep_alive_interval": 3600.0})
        # --versions 0: the rounds alone (what the rendezvous costs, without the commit's load)
        out["versions"] = _versions(fleet, client, meter, run_id, args, n) if args.versions else None

        fleet.all("settings", {"min_nodes": out["min_nodes_reform"]})
        victims = [fleet.names[-1]]
        _line(f"N={n}: kill 1 node, re-form")
        m, t0 = meter.mark(), time.time()
        fleet.kill(victims)
        out["reform_1"] = {**_round(fleet.all("reform", (args.settle, args.join_timeout)), t0, "one lost"), **meter.since(m)}

        victims = fleet.names[-1 - lost10:-1]
        if victims:
            _line(f"N={n}: kill {len(victims)} nodes at once, re-form")
            m, t0 = meter.mark(), time.time()
            fleet.kill(victims)
            out["reform_10pct"] = {**_round(fleet.all("reform", (args.settle, args.join_timeout)), t0, f"{len(victims)} lost"),
                                   "lost": len(victims), **meter.since(m)}
        failed = False
    finally:
        if fleet is not None:
            fleet.close(kill=failed)
        try:
            client.delete_prefix(f"/resilient/{run_id}/")
            client.delete_prefix(f"/resilient/rdzv/{run_id}/")
        finally:
            client.close()
            shutil.rmtree(os.path.join(shm, run_id), ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
    return out


def _versions(fleet: Fleet, client: EtcdClient, meter: Meter, run_id: str, args, n: int) -> dict:
    """``args.versions`` versions one after another: each written by every node, then waited
    for until its peer-tier commit record exists. The orchestrator's own polls are ranges,
    subtracted from the counts. One version before them is not measured: there each node
    reads the node registry whole, once in its life (N entries), not once per version."""
    def one(step: int) -> float | None:
        """The commit latency of ``step`` (None: not committed within --commit-timeout)."""
        nonlocal own
        t0 = time.monotonic()
        fleet.all("version", step)
        deadline = t0 + args.commit_timeout
        while client.get(commit_key(run_id, REPLICATED, step)) is None:
            own += 1
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        own += 1
        return time.monotonic() - t0

    own = 0
    _line(f"N={n}: version 0 (warm-up, not measured)")
    if one(0) is None:
        errors = fleet.all("errors")
        first = next((e["first"] for e in errors if e["first"]), [])
        raise RuntimeError(f"N={n}: the warm-up version was not committed within --commit-timeout "
                           f"({sum(e['count'] for e in errors)} upload errors; first: {first!r:.1500})")
    _settled_compaction(client)
    db0 = scrape(meter.url).get("db_in_use", 0.0)
    m, own = meter.mark(), 0
    latencies = []
    for step in range(1, args.versions + 1):
        _line(f"N={n}: version {step}/{args.versions}")
        latency = one(step)
        if latency is not None:
            latencies.append(latency)
    d = meter.since(m)
    errors = fleet.all("errors")
    _settled_compaction(client)
    db1 = scrape(meter.url).get("db_in_use", 0.0)
    v = max(1, args.versions)
    lat = sorted(latencies)
    return {**d, "count": args.versions, "committed": len(latencies),
            "upload_errors": sum(e["count"] for e in errors), "first_errors": [e["first"] for e in errors[:3]],
            "writes_per_version": round(d["writes"] / v, 2), "txn_per_version": round(d["txn"] / v, 2),
            "requests_per_version": round((d["requests"] - own) / v, 1),
            "bytes_per_version": round((d["rx_bytes"] + d["tx_bytes"]) / v),
            "commit_latency_s": {"median": round(lat[len(lat) // 2], 3) if lat else None,
                                 "max": round(lat[-1], 3) if lat else None},
            "db_growth_per_1000_versions_bytes": round((db1 - db0) * 1000 / v)}


def _settled_compaction(client: EtcdClient) -> None:
    """Compact etcd's history to now and give its background compaction a moment to free the
    pages (etcd reports the space in use only once it has)."""
    client.compact(client.revision())
    time.sleep(1.0)


def plot(results: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:  # matplotlib not installed: the numbers stand without the picture
        return False
    ns = [r["nodes"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("first_round", "first round"), ("reform_1", "re-form, 1 lost"),
                       ("reform_10pct", "re-form, 10% lost")):
        a.plot(ns, [max(r.get(key, {}).get("seconds", 0), 1e-3) for r in results], "o-", label=label)
    if all(r["versions"] for r in results):
        a.plot(ns, [max(r["versions"]["commit_latency_s"]["median"] or 1e-3, 1e-3) for r in results], "s--",
               label="commit latency")
    a.set(xscale="log", yscale="log", xlabel="nodes", ylabel="seconds", title="time")
    for key, label in (("first_round", "writes per first round"), ("reform_1", "writes per re-form")):
        b.plot(ns, [max(r.get(key, {}).get("writes", 0), 1) for r in results], "o-", label=label)
    if all(r["versions"] for r in results):
        b.plot(ns, [max(r["versions"]["writes_per_version"], 0.1) for r in results], "s--", label="writes per version")
    b.plot(ns, [max(r["idle"]["keepalives_per_s"], 0.1) for r in results], "^:", label="keep-alives per s")
    b.set(xscale="log", yscale="log", xlabel="nodes", ylabel="etcd operations", title="etcd load")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def results_row(results: list[dict], cmd: str) -> str:
    cells = []
    for r in results:
        v = r["versions"]
        commit = f"{v['writes_per_version']} w/version, commit {v['commit_latency_s']['median']} s, " if v else ""
        cells.append(f"N={r['nodes']}: first {r['first_round']['seconds']} s/{r['first_round']['writes']:.0f} w, "
                     f"re-form 1 {r['reform_1']['seconds']} s, 10% {r.get('reform_10pct', {}).get('seconds')} s, "
                     f"{commit}{r['idle']['keepalives_per_s']} keep-alives/s")
    return f"| control plane at scale (`{cmd}`) | " + "; ".join(cells) + " |"


def bench_row(results: list[dict], cmd: str, wall: float, raw: str, png: str) -> dict:
    """The run's row in bench/run.py's format (``bench/results/scale.json``), so that
    ``bench/run.py --render-only`` keeps it in RESULTS.md."""
    from common import fig, goal, row

    figures: dict[str, dict] = {}
    for r in results:
        n, v = r["nodes"], r["versions"]
        figures[f"first_{n}"] = fig([r["first_round"]["seconds"]], "s", f"N={n}: first round, all N join")
        figures[f"first_writes_{n}"] = fig([r["first_round"]["writes"]], "writes", f"N={n}: etcd writes, first round")
        figures[f"reform1_{n}"] = fig([r["reform_1"]["seconds"]], "s", f"N={n}: re-form after 1 node killed")
        figures[f"reform1_writes_{n}"] = fig([r["reform_1"]["writes"]], "writes", f"N={n}: etcd writes, that re-form")
        if "reform_10pct" in r:
            figures[f"reform10_{n}"] = fig([r["reform_10pct"]["seconds"]], "s",
                                           f"N={n}: re-form after {r['reform_10pct']['lost']} killed at once")
        if v is not None:   # --versions 0: the rounds alone
            figures[f"wpv_{n}"] = fig([v["writes_per_version"]], "writes",
                                      f"N={n}: etcd writes per committed version ({v['committed']}/{v['count']} committed)")
            figures[f"bpv_{n}"] = fig([v["bytes_per_version"] / 1e3], "kB", f"N={n}: etcd bytes in+out per version")
            if v["commit_latency_s"]["median"] is not None:
                figures[f"commit_{n}"] = fig([v["commit_latency_s"]["median"]], "s", f"N={n}: commit latency (median)")
        figures[f"ka_{n}"] = fig([r["idle"]["keepalives_per_s"]], "/s", f"N={n}: lease keep-alives per second, idle")
        figures[f"idle_req_{n}"] = fig([r["idle"]["requests_per_s"] / n], "/s",
                                       f"N={n}: etcd requests per node per second, idle (keep-alives, waiting-node asks, node-loss checks)")
        figures[f"idle_out_{n}"] = fig([r["idle"]["etcd_out_bytes_per_s"] / n / 1e3], "kB/s",
                                       f"N={n}: etcd bytes out per node per second, idle")
        if v is not None and v["db_growth_per_1000_versions_bytes"] >= 0:  # negative: older history freed meanwhile
            figures[f"db_{n}"] = fig([v["db_growth_per_1000_versions_bytes"] / 1e6], "MB",
                                     f"N={n}: etcd db growth per 1000 versions (compacted)")
    big, small = results[-1], results[0]
    # The commit's own writes (the leader's record, once per worker group, came with the warm-up version).
    versions = all(r["versions"] for r in results)
    wpv = [round(r["versions"]["writes"] / max(1, r["versions"]["count"]), 2) for r in results] if versions else []
    ka = [r["idle"]["keepalives_per_s"] / r["nodes"] for r in results]
    idle = [r["idle"]["requests_per_s"] / r["nodes"] for r in results]
    out = [r["idle"]["etcd_out_bytes_per_s"] / r["nodes"] / 1e3 for r in results]
    least = min(range(len(results)), key=lambda i: results[i]["nodes"])   # the smallest fleet
    goals = [
        goal(f"re-form after one lost node ≤ 5 s at N={big['nodes']}", big["reform_1"]["seconds"] <= 5,
             f"{big['reform_1']['seconds']} s (of it the last call, {big['conf']['last_call_timeout']} s)"),
        *([goal("etcd writes per committed version ≤ 2 and not growing with N",
                max(wpv) <= 2.0 and max(wpv) - min(wpv) <= 0.1,
                f"{', '.join(f'{w}' for w in wpv)} at N={', '.join(str(r['nodes']) for r in results)} "
                "(2 puts in one txn per version; the leader's record, once per worker group, not counted)")]
          if versions else []),
        goal("keep-alive load linear in N", max(ka) <= 2 * min(ka),
             f"{', '.join(f'{k:.2f}' for k in ka)} keep-alives per node per second"),
        # At most linear: per node it may fall with N (the waiting-node asks slow down with the
        # fleet), never rise past 2x of the smallest fleet's.
        goal("etcd load while training at most linear in N (requests and bytes per node per second within "
             "2x of the smallest N's)",
             max(idle) <= 2 * idle[least] and max(out) <= 2 * out[least],
             f"{', '.join(f'{k:.2f}' for k in idle)} requests and {', '.join(f'{k:.1f}' for k in out)} kB "
             "per node per second (keep-alives; torch's agent loop asking for waiting nodes every 0.1 s, "
             "read from etcd once per 0.1 s + N ms; node-loss checks of 3 ring neighbours; of all, what "
             "changed, every max(10, N/8))"),
    ]
    ratio = ({"wpv": {"value": round(wpv[-1] / wpv[0], 3) if wpv[0] else None, "better": "lower",
                      "label": f"etcd writes per committed version at N={big['nodes']} / at N={small['nodes']}"}}
             if versions else
             {"reform": {"value": round(big["reform_1"]["seconds"] / max(1e-3, small["reform_1"]["seconds"]), 2),
                         "better": "lower", "label": f"re-form after one lost node at N={big['nodes']} / at "
                                                     f"N={small['nodes']}"}})
    title = "Control plane at scale: N simulated nodes against one etcd (bench/scale.py)" + (
        "" if versions else ", the rounds alone (--versions 0)")
    return {**row(title, figures, ratio, goals,
                  [f"raw figures per phase (requests, bytes, CPU of the simulator and of etcd): {raw}"]),
            "command": cmd, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": os.uname().nodename, "wall_s": round(wall, 1), "png": [png]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,32,128", help="node counts, comma separated")
    p.add_argument("--rdzv-endpoint", default="", help="your etcd (HOST:PORT,...); default: start one")
    p.add_argument("--members", type=int, default=1, help="members of the etcd started here (1 or 3)")
    p.add_argument("--versions", type=int, default=20, help="versions committed per N (0: the rounds alone)")
    p.add_argument("--procs", type=int, default=4, help="simulator processes")
    p.add_argument("--domains", type=int, default=8, help="failure domains the nodes are spread over")
    p.add_argument("--k", type=int, default=1, help="peer replicas per version")
    p.add_argument("--commit", choices=("leader", "etcd"), default="leader",
                   help="the memory tiers' commit protocol (etcd: every node writes its holds, N + 1 writes)")
    p.add_argument("--handler", choices=("keys", "torch"), default="keys",
                   help="the rendezvous handler (launch.rendezvous): keys (a key per node) or torch's (one state key)")
    p.add_argument("--lost-fraction", type=float, default=0.1)
    p.add_argument("--last-call", type=float, default=0.0,
                   help="last_call_timeout, seconds (default: 1; with --handler torch max(1, 0.02 × N))")
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("--keep-alive", type=float, default=5.0, help="keep_alive_interval, seconds")
    p.add_argument("--lease-ttl", type=float, default=10.0)
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds without a waiting node before a re-form counts as done")
    p.add_argument("--poll", type=float, default=0.1, help="poll_interval, seconds")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of idle keep-alive measurement")
    p.add_argument("--commit-timeout", type=float, default=30.0)
    p.add_argument("--gather-timeout", type=float, default=10.0,
                   help="the leader's wait for every node's holds of a version, seconds (the agents' "
                        "default: 10; hundreds of simulated nodes on a few cores may need longer)")
    p.add_argument("--out", default="bench/results/scale")
    p.add_argument("--row", default="bench/results/scale.json",
                   help="where the bench/run.py row goes ('' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("join_timeout", "keep_alive", "lease_ttl", "poll", "idle", "commit_timeout", "gather_timeout", "settle"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    ns = [int(x) for x in args.nodes.split(",") if x.strip()]
    # A SIGTERM (a timeout, a scheduler) unwinds like Ctrl-C: nodes, etcd and tmpfs cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster, started = None, time.monotonic()
    try:
        if args.rdzv_endpoint:
            endpoint = args.rdzv_endpoint
            metrics_url = f"http://{endpoint.split(',')[0].split('://')[-1]}/metrics"
            etcd_pids: list[int] = []
        else:
            cluster = EtcdCluster(args.members).start()
            endpoint, metrics_url, etcd_pids = cluster.endpoint, cluster.metrics_url, cluster.pids()
        results = []
        for n in ns:
            r = simulate(n, endpoint, metrics_url, etcd_pids, args)
            r["etcd_members"] = args.members if cluster else "external"
            results.append(r)
            fr, v = r["first_round"], r["versions"]
            _line("")
            print(f"N={n}: first round {fr['seconds']} s ({fr['joined']} joined, rounds {fr['rounds']}, "
                  f"{fr['writes']:.0f} writes, {fr['requests']:.0f} requests; sim busy {fr['sim_busy']}, "
                  f"etcd cpu {fr['etcd_cpu_s']} s) | re-form 1 lost {r['reform_1']['seconds']} s "
                  f"(rendezvous {r['reform_1']['rendezvous_s']} s, {r['reform_1']['writes']:.0f} writes, etcd cpu "
                  f"{r['reform_1']['etcd_cpu_s']} s), {r.get('reform_10pct', {}).get('lost', 0)} lost "
                  f"{r.get('reform_10pct', {}).get('seconds')} s | "
                  + (f"{v['committed']}/{v['count']} versions committed, "
                     f"{v['writes_per_version']} writes and {v['requests_per_version']} requests per version, "
                     f"commit {v['commit_latency_s']['median']} s | db +"
                     f"{v['db_growth_per_1000_versions_bytes'] / 1e6:.2f} MB per 1000 versions | " if v else "")
                  + f"idle {r['idle']['keepalives_per_s']} keep-alives/s, {r['idle']['requests_per_s']} requests/s",
                  flush=True)
            (out / "scale.json").write_text(json.dumps(results, indent=1))
        cmd = ("python bench/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
        if plot(results, out / "scale.png"):
            print(f"plot: {out / 'scale.png'}")
        if args.row:
            row = bench_row(results, cmd, time.monotonic() - started, str(out / "scale.json"),
                            str((out / "scale.png").relative_to(Path(args.row).parent)) if
                            (out / "scale.png").is_relative_to(Path(args.row).parent) else str(out / "scale.png"))
            Path(args.row).write_text(json.dumps(row, indent=1))
        print(results_row(results, cmd))
    finally:
        if cluster is not None:
            cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
