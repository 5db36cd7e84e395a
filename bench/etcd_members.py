"""What a three-member etcd costs beside one member (issue 38, item 2): re-form and per version.

    python bench/etcd_members.py [--nodes 8] [--versions 20] [--procs 2] [--repeat 1]

``resilient launch`` grows its embedded etcd into a cluster of ``launch.etcd_members`` (3)
members so that no agent is special (resilient.control.members). Every write then needs a
majority of three to persist it instead of one member alone. This runs the control-plane
simulator of bench/scale.py (N simulated nodes: the real rendezvous handler, leases, node
registry, replicator committing tiny versions) against a one-member and a three-member etcd
on loopback (resilient.etcd.cluster: the members' raft timings are the embedded cluster's),
alternately, ``--repeat`` times each, in one run, and prints the figures side by side: the
first round, the re-form after one node is killed, the commit latency and the etcd requests
and writes per committed version, and etcd's CPU seconds per phase (all members together).
It also times what the cluster exists for: one member (the leader) killed, until a write is
accepted again by the two others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale  # noqa: E402

from resilient.etcd.cluster import EtcdCluster  # noqa: E402


def member_loss(cluster: EtcdCluster) -> float:
    """Kill the leader; seconds until a write through the other members succeeds."""
    from resilient.etcd.client import EtcdClient

    def member_id(m) -> int:
        with m.client(retry_timeout=timedelta(seconds=5)) as c:
            return c.member_id()

    with cluster.members[0].client(retry_timeout=timedelta(seconds=30)) as c:
        leader = int(c._post("/maintenance/status", {}, "status")["leader"])
    victim = next(m for m in cluster.members if member_id(m) == leader)
    others = ",".join(m.endpoint for m in cluster.members if m is not victim)
    with EtcdClient(others, retry_timeout=timedelta(seconds=60)) as c:
        c.put("/bench/warm", "1")
        t = time.monotonic()
        victim.kill()
        c.put("/bench/after-loss", "1")
        took = time.monotonic() - t
    victim.start()
    return took


def one(members: int, n: int, args) -> dict:
    sargs = scale.build_parser().parse_args(["--nodes", str(n), "--versions", str(args.versions),
                                             "--procs", str(args.procs), "--lease-ttl", "10", "--members", str(members)])
    with EtcdCluster(members) as cluster:
        r = scale.simulate(n, cluster.endpoint, cluster.metrics_url, cluster.pids(), sargs)
        if members > 1:
            r["member_loss_s"] = round(member_loss(cluster), 3)
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--versions", type=int, default=20)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", default="bench/results/etcd_members.json")
    args = p.parse_args(argv)
    runs: dict[int, list[dict]] = {1: [], 3: []}
    for _ in range(args.repeat):
        for members in (1, 3):   # alternately: a drift of the host's load falls on both
            runs[members].append(one(members, args.nodes, args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))

    def med(members: int, get) -> float:
        vals = [get(r) for r in runs[members] if get(r) is not None]
        return round(statistics.median(vals), 3) if vals else float("nan")

    rows = [
        ("first round, all N join (s)", lambda r: r["first_round"]["seconds"]),
        ("re-form after 1 node killed (s)", lambda r: r["reform_1"]["seconds"]),
        ("etcd CPU in that re-form (s, all members)", lambda r: r["reform_1"]["etcd_cpu_s"]),
        ("commit latency per version, median (s)", lambda r: (r["versions"] or {}).get("commit_latency_s", {}).get("median")),
        ("etcd requests per committed version", lambda r: (r["versions"] or {}).get("requests_per_version")),
        ("etcd writes per committed version", lambda r: (r["versions"] or {}).get("writes_per_version")),
        ("etcd CPU per committed version (ms, all members)",
         lambda r: 1000 * r["versions"]["etcd_cpu_s"] / max(1, r["versions"]["committed"]) if r["versions"] else None),
    ]
    cmd = "python bench/etcd_members.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\ncommand: {cmd.strip()}\n\n| N={args.nodes}, median of {args.repeat} | 1 member | 3 members | 3 / 1 |")
    print("| --- | --- | --- | --- |")
    for name, get in rows:
        a, b = med(1, get), med(3, get)
        print(f"| {name} | {a} | {b} | {b / a:.2f}x |" if a else f"| {name} | {a} | {b} | - |")
    print(f"| leader member killed, until a write is accepted again (s) | - | {med(3, lambda r: r.get('member_loss_s'))} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
