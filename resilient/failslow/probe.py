"""The probe that tells a slow link from a slow process, and finds which one.

Step timings alone cannot always tell them apart: when a rank's whole process
is slow (stopped, starved, its GPU throttled while it also drives the
collectives), it is slow *inside* the collectives too, so every rank's wait
grows, as it would behind a slow link. When the detector suspects a link, every
rank runs this probe together (rank 0's suspicion, announced at a step
boundary, is acted on by every rank there), once per suspicion, off the hot path:

1. **compute**: the same small matrix product, ``COMPUTE_REPS`` times, timed
   (minus the run-queue delay: a shared host's CPU contention is not the rank's
   own slowness). Long enough to span several periods of a duty-cycled stall.
2. **edges**: one ``PAYLOAD``-byte message around the ring (each rank sends to
   its right and receives from its left), ``EDGE_REPS`` times, each after a
   barrier: the mean time to receive from the left is the edge ``left → rank``
   (a rank behind a lossy ingress also leaves each barrier late, so its outgoing
   edge looks slow too: the slow edges share it).

:func:`judge` reads the two vectors: a rank whose compute is slow is a slow
device (every rank of one node: the host); otherwise edges much slower than the
others are a slow link, located at the rank (and node) they share.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any, Sequence

from resilient.failslow.timing import open_run_delay, run_delay

COMPUTE_REPS = 160    # ~40 ms on one CPU core: spans a few periods of a duty-cycled stall
MATRIX = 256
PAYLOAD = 1 << 18
EDGE_REPS = 5
SLOW_COMPUTE = 1.3    # a rank's probe compute this much slower than the median: slow
SLOW_EDGE = 10.0      # an edge this much slower than the median edge: slow (a lossy link: 100x; noise on a loaded host: up to ~5x)


def compute_seconds(device: Any = None) -> float:
    """The probe's compute alone, on this process: seconds of ``COMPUTE_REPS`` small matrix
    products on one thread of ``device``, minus this thread's run-queue delay (a shared
    host's CPU contention is not the device's own slowness). Also what a node marked slow
    runs before it may rejoin (:mod:`~resilient.failslow.replace`)."""
    import os

    import torch

    device = torch.device(device or "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    a = torch.randn(MATRIX, MATRIX, generator=torch.Generator().manual_seed(0)).to(device)
    fd = open_run_delay()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one thread: the same work on every rank, its run-queue delay all seen
    try:
        a @ a   # warm the kernel
        sync(device)
        t0, q0 = time.perf_counter(), run_delay(fd)
        for _ in range(COMPUTE_REPS):
            a = (a @ a).clamp_(-1, 1)
        sync(device)
        return max(0.0, time.perf_counter() - t0 - (run_delay(fd) - q0))
    finally:
        torch.set_num_threads(threads)
        if fd is not None:
            os.close(fd)


def run_probe(group: Any, rank: int, world: int, device: Any = None) -> tuple[list[float], list[float]]:
    """Collective over ``group``: (compute seconds per rank on ``device``, seconds of the
    edge into each rank)."""
    import torch
    import torch.distributed as dist

    compute = compute_seconds(device)
    left, right = (rank - 1) % world, (rank + 1) % world
    send = torch.zeros(PAYLOAD // 4, dtype=torch.float32)
    recv = torch.empty_like(send)
    times = []
    for i in range(EDGE_REPS + 1):   # the first one warms the connections
        # everyone starts together: in a ring, a receiver that got its message late would
        # otherwise send late, and the lateness would travel round the ring as "slow edges"
        dist.barrier(group=group)
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, right), group),
               dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, left), group)]
        works = dist.batch_isend_irecv(ops)
        works[1].wait()
        took = time.perf_counter() - t0
        works[0].wait()
        if i:
            times.append(took)
    mine = torch.zeros(1 + 2 * world, dtype=torch.float64)
    mine[1 + 2 * rank] = compute
    # the mean: a lossy TCP edge recovers most drops at once and stalls for a retransmission
    # timeout (≥ 200 ms) on some, so it is slow on average, not every time
    mine[2 + 2 * rank] = sum(times) / len(times)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    values = mine[1:].view(world, 2).tolist()
    return [v[0] for v in values], [v[1] for v in values]


def judge(compute: Sequence[float], edges_in: Sequence[float], nodes: Sequence[str]) -> dict:
    """What the probe says: ``cause`` (device, host, link), ``slow_ranks``, ``slow_rank``,
    ``slow_node``, ``factor`` and the ``evidence`` (the two vectors and the slow edges)."""
    world = len(compute)
    # against the faster half: when a host's ranks are half the job, the median is one of them
    med_c = median(sorted(compute)[:max(1, world // 2)]) or 1e-9
    ratios = [c / med_c for c in compute]
    slow = [r for r in range(world) if ratios[r] >= SLOW_COMPUTE]
    evidence = {"probe_compute_seconds": [round(c, 6) for c in compute],
                "probe_edge_seconds": [round(e, 6) for e in edges_in]}
    if slow and len(slow) < world:
        worst = max(slow, key=lambda r: ratios[r])
        node = nodes[worst]
        mates = [r for r in range(world) if nodes[r] == node]
        host = 1 < len(mates) < world and all(m in slow for m in mates)
        return {"cause": "host" if host else "device", "slow_rank": worst, "slow_ranks": mates if host else [worst],
                "slow_node": node, "factor": ratios[worst], "evidence": evidence}
    med_e = median(sorted(edges_in)[:max(1, world // 2)]) or 1e-9
    bad = [((r - 1) % world, r) for r in range(world) if edges_in[r] / med_e >= SLOW_EDGE]
    evidence["slow_edges"] = [list(e) for e in bad]
    if not bad:
        return {"cause": "link", "slow_rank": None, "slow_ranks": [], "slow_node": None, "factor": None,
                "evidence": evidence}
    # the end every slow edge shares (one rank's NIC, one node's link), else the worst edge's receiver
    common = set(bad[0])
    for e in bad[1:]:
        common &= set(e)
    counts: dict[str, int] = {}
    for e in bad:
        for r in set(e):
            counts[nodes[r]] = counts.get(nodes[r], 0) + 1
    worst = max(bad, key=lambda e: edges_in[e[1]])[1]   # the receiver of the slowest edge
    at = worst if worst in common or not common else min(common)
    node = nodes[at] if common else max(counts, key=counts.get)
    return {"cause": "link", "slow_rank": at, "slow_ranks": [at], "slow_node": node,
            "factor": None, "evidence": evidence}
