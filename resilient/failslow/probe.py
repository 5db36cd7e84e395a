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
2. **edges**: each ring edge (ranks ``r`` and ``r + 1``) timed on its own, as a
   round trip: one ``PAYLOAD``-byte message each way, ``EDGE_REPS`` times, timed
   by the pair's first rank, in two or three phases of disjoint pairs. A lossy
   path into a node stalls both ways of a round trip through it (its data in
   one direction, the ACKs in the other), and the pair runs in lock step after
   its first exchange, so one rank's lateness is not charged to its
   neighbours' edges. (The edges were timed one way before, every rank at once
   after a barrier: a rank behind a lossy ingress left the barrier late and
   made edges it did not touch look slow. A CI run named the lossy node's
   neighbour, and in two 900 s soaks 1 of 8 probes during a lossy link named
   the wrong node and 3 located none.)

:func:`judge` reads the two vectors: a rank whose compute is slow is a slow
device (every rank of one node: the host); otherwise edges much slower than the
others are a slow link, located at the rank (and node) that the slow edges touch
most.
"""

from __future__ import annotations

import time
from collections import Counter
from statistics import median
from typing import Any, Sequence

from resilient.failslow.timing import open_run_delay, run_delay

COMPUTE_REPS = 160    # ~40 ms on one CPU core: spans a few periods of a duty-cycled stall
MATRIX = 256
PAYLOAD = 1 << 18
EDGE_REPS = 10      # a lossy link stalls some messages, not all: more of them, fewer misses
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


def ring_phases(world: int) -> list[list[int]]:
    """The ring's edges (edge ``r`` joins ranks ``r`` and ``r + 1``) in phases of disjoint
    pairs, so that no rank is in two pairs at once: two phases for an even ring, three for an
    odd one (its last edge on its own), one edge for two ranks, none for one."""
    if world < 2:
        return []
    if world == 2:
        return [[0]]
    last = world - (world % 2)
    return [list(range(0, last, 2)), list(range(1, last, 2))] + ([[world - 1]] if world % 2 else [])


def _round_trip_seconds(group: Any, peer: int, lead: bool) -> float:
    """Mean seconds of one ``PAYLOAD``-byte message to group rank ``peer`` and one back,
    over ``EDGE_REPS``, timed by the ``lead`` end (the other answers; returns 0)."""
    import torch
    import torch.distributed as dist

    send = torch.zeros(PAYLOAD // 4, dtype=torch.float32)
    recv = torch.empty_like(send)
    other = dist.get_global_rank(group, peer)
    times = []
    # the first exchange waits for the later of the two to arrive and warms the connection;
    # after it the pair runs in lock step, so nobody else's lateness is timed
    for i in range(EDGE_REPS + 1):
        t0 = time.perf_counter()
        if lead:
            dist.send(send, other, group=group)
            dist.recv(recv, other, group=group)
        else:
            dist.recv(recv, other, group=group)
            dist.send(send, other, group=group)
        if i:
            times.append(time.perf_counter() - t0)
    # the mean: a lossy TCP path recovers most drops at once and stalls for a retransmission
    # timeout (≥ 200 ms) on some, so it is slow on average, not every time
    return sum(times) / len(times) if lead else 0.0


def run_probe(group: Any, rank: int, world: int, device: Any = None) -> tuple[list[float], list[float]]:
    """Collective over ``group``: (compute seconds per rank on ``device``, round-trip
    seconds of each ring edge: ``edges[r]`` between ranks ``r`` and ``r + 1``)."""
    import torch
    import torch.distributed as dist

    compute = compute_seconds(device)
    mine = torch.zeros(2 * world, dtype=torch.float64)
    mine[rank] = compute
    for phase in ring_phases(world):
        dist.barrier(group=group)
        for edge in phase:
            if rank in (edge, (edge + 1) % world):
                lead = rank == edge
                mine[world + edge] = _round_trip_seconds(group, (rank + (1 if lead else -1)) % world, lead)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    values = mine.tolist()
    edges = values[world:]
    if world == 2:
        edges[1] = edges[0]   # the same pair
    return values[:world], edges


def judge(compute: Sequence[float], edges: Sequence[float], nodes: Sequence[str]) -> dict:
    """What the probe says: ``cause`` (device, host, link), ``slow_ranks``, ``slow_rank``,
    ``slow_node``, ``factor`` and the ``evidence`` (the vectors and the slow edges).
    ``edges[r]``: the round trip between ranks ``r`` and ``r + 1`` (around the ring)."""
    world = len(compute)
    # against the median of the ranks outside the largest node's worth of the slowest: a slow
    # host's ranks are never in it, and one noisy rank does not make the others look slow
    # (the fastest alone was the baseline of a 3-rank job: 2 of 3 ranks at 1.34x of it on
    # this shared host, and a lossy link was called a slow device)
    largest = Counter(nodes).most_common(1)[0][1]
    med_c = median(sorted(compute)[:max(1, world - largest)]) or 1e-9
    ratios = [c / med_c for c in compute]
    slow = [r for r in range(world) if ratios[r] >= SLOW_COMPUTE]
    evidence = {"probe_compute_seconds": [round(c, 6) for c in compute],
                "probe_edge_seconds": [round(e, 6) for e in edges]}
    if slow and len(slow) < world:
        worst = max(slow, key=lambda r: ratios[r])
        node = nodes[worst]
        mates = [r for r in range(world) if nodes[r] == node]
        host = 1 < len(mates) < world and all(m in slow for m in mates)
        return {"cause": "host" if host else "device", "slow_rank": worst, "slow_ranks": mates if host else [worst],
                "slow_node": node, "factor": ratios[worst], "evidence": evidence}
    # each pair once; edges within a node (shared memory, NVLink) are judged against each
    # other, not against the network's (they are always much faster)
    timed: dict[tuple[int, int], float] = {}
    for r in range(world):
        pair = (min(r, (r + 1) % world), max(r, (r + 1) % world))
        if pair[0] != pair[1]:
            timed[pair] = max(timed.get(pair, 0.0), edges[r])
    bad: list[tuple[int, int]] = []
    for inside in (False, True):
        kind = {e: t for e, t in timed.items() if (nodes[e[0]] == nodes[e[1]]) == inside}
        med_e = median(sorted(kind.values())[:max(1, len(kind) // 2)]) if kind else 0.0
        bad += [e for e, t in kind.items() if t >= SLOW_EDGE * max(med_e, 1e-9)]
    bad.sort()
    evidence["slow_edges"] = [list(e) for e in bad]
    if not bad:
        return {"cause": "link", "slow_rank": None, "slow_ranks": [], "slow_node": None, "factor": None,
                "evidence": evidence}

    # The slow pairs share the slow end: scored by the slow pairs touching it, then the
    # seconds of all its pairs (a lossy path slows every pair through it, most past the
    # threshold, the rest still above the clean ones).
    def score(ranks: set[int]) -> tuple[int, float]:
        touching = [e for e in timed if e[0] in ranks or e[1] in ranks]
        return (sum(1 for e in bad if e in touching), sum(timed[e] for e in touching))

    by_node: dict[str, set[int]] = {}
    for r in range(world):
        by_node.setdefault(nodes[r], set()).add(r)
    node = max(sorted(by_node), key=lambda n: score(by_node[n]))
    at = max(sorted(by_node[node]), key=lambda r: score({r}))
    return {"cause": "link", "slow_rank": at, "slow_ranks": [at], "slow_node": node,
            "factor": None, "evidence": evidence}
