"""The probe that tells a slow link from a slow process, and finds which one.

Step timings alone cannot always tell them apart: when a rank's whole process
is slow (stopped, starved, its GPU throttled while it also drives the
collectives), it is slow *inside* the collectives too, so every rank's wait
grows, as it would behind a slow link. When the detector suspects a link, every
rank runs this probe together (rank 0's suspicion, announced at a step
boundary, is acted on by every rank there), once per suspicion, off the hot path:

1. **compute**: the same small matrix product, ``COMPUTE_REPS`` times in
   ``COMPUTE_ROUNDS`` rounds, each timed (minus the run-queue delay: a shared
   host's CPU contention is not the rank's own slowness); the fastest round
   counts. On CPU the ranks of one machine take their rounds in turns (ranks
   side by side on shared cores time each other). A round (~18 ms on a CPU
   core) outlasts a run window of a duty-cycled stall (10 ms of every 20 ms
   at 2x, the chaos harness's slow device), so it holds at least one whole
   stop and a slow process is slow in all of them (x1.5 at least); another
   job's burst slows some rounds, not all.
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

import os
import time
from collections import Counter
from statistics import median
from typing import Any, Sequence

from resilient.failslow.timing import open_run_delay, run_delay

COMPUTE_REPS = 160    # ~40 ms on one CPU core in all
COMPUTE_ROUNDS = 4    # ~10 ms each: one round slowed by a neighbour's burst does not count
MATRIX = 256
PAYLOAD = 1 << 18
EDGE_REPS = 10      # a lossy link stalls some messages, not all: more of them, fewer misses
SLOW_COMPUTE = 1.3    # a rank's probe compute this much slower than the median: slow
SLOW_EDGE = 10.0      # an edge this much slower than the median edge: slow (a lossy link: 100x; noise on a loaded host: up to ~5x)


class _ComputeRounds:
    """Times rounds of the probe's compute on one thread of ``device``: each round
    ``COMPUTE_REPS // COMPUTE_ROUNDS`` small matrix products, minus the thread's run-queue
    delay over it (a shared host's CPU contention is not the device's own slowness). On CPU
    the rounds go round the cores the thread may run on, one core each: the cores of a shared
    host are not alike (this VM's two, both busy: 70 ms on one, 90 ms on the other for the
    same round, steadily, and a process stays on its core), and the fastest round is the
    rank's pace on its best core, not the core it happened to sit on."""

    def __init__(self, device: Any = None):
        import torch

        self.device = torch.device(device or "cpu")
        self._sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        self._a = torch.randn(MATRIX, MATRIX, generator=torch.Generator().manual_seed(0)).to(self.device)
        pin = self.device.type == "cpu" and hasattr(os, "sched_setaffinity")
        self._cores = sorted(os.sched_getaffinity(0)) if pin else []
        self._rounds = 0

    def __enter__(self) -> "_ComputeRounds":
        import torch

        self._fd = open_run_delay()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)   # one thread: the same work on every rank, its run-queue delay all seen
        self._a @ self._a   # warm the kernel
        self._sync(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if len(self._cores) > 1:
            os.sched_setaffinity(0, self._cores)
        torch.set_num_threads(self._threads)
        if self._fd is not None:
            os.close(self._fd)

    def round(self) -> float:
        if len(self._cores) > 1:   # this thread only (Linux): the process's other threads keep theirs
            os.sched_setaffinity(0, {self._cores[self._rounds % len(self._cores)]})
        self._rounds += 1
        t0, q0 = time.perf_counter(), run_delay(self._fd)
        for _ in range(COMPUTE_REPS // COMPUTE_ROUNDS):
            self._a = (self._a @ self._a).clamp_(-1, 1)
        self._sync(self.device)
        return max(0.0, time.perf_counter() - t0 - (run_delay(self._fd) - q0))


def compute_seconds(device: Any = None) -> float:
    """The probe's compute alone, on this process: seconds of ``COMPUTE_REPS`` small matrix
    products on one thread of ``device``, at the pace of the fastest of ``COMPUTE_ROUNDS``
    rounds (:class:`_ComputeRounds`). What a node marked slow runs before it may rejoin
    (:mod:`~resilient.failslow.replace`); the probe times the same rounds in turns
    (:func:`_compute_in_turns`)."""
    with _ComputeRounds(device) as timer:
        return COMPUTE_ROUNDS * min(timer.round() for _ in range(COMPUTE_ROUNDS))


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


def machine_id() -> int:
    """This kernel's boot id (shared by every container and agent on one machine, so by every
    process that shares its cores), hashed to a signed 64-bit int; the hostname where there is
    none."""
    import hashlib
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip()
    except OSError:
        key = socket.gethostname()
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)


def _compute_in_turns(group: Any, rank: int, world: int, device: Any) -> float:
    """Collective: this rank's compute seconds (as :func:`compute_seconds`), its
    ``COMPUTE_ROUNDS`` rounds timed in turns. On a GPU every rank times its own device at
    once; on CPU the ranks on one machine take turns, one round each per pass, every machine
    at once. The fastest round counts. Why both, measured on this 2-core host: ranks computing
    side by side on shared cores time each other (two processes at once: one 66 ms, the other
    85 ms for the same work, steadily, 64-67 ms alone: 1.3x, the probe's own threshold, and a
    CI run judged a clean probe a slow device at 1.34x); and one rank's turn can meet another
    job's burst (a clean probe timed one at a time came out 101, 89 and 67 ms), which its other
    rounds, spread over the passes, do not. A process stopped in a duty cycle whose run windows are
    shorter than a round (the chaos harness's slow device: chaos/dutycycle.py keeps them so on a
    loaded host) is slow in every round. Costs ranks-per-machine
    times ~40 ms on CPU."""
    import torch
    import torch.distributed as dist

    ids = torch.zeros(world, dtype=torch.int64)
    # on a GPU each rank has its own device: every rank its own "machine", no turns
    ids[rank] = machine_id() if torch.device(device or "cpu").type == "cpu" else rank
    dist.all_reduce(ids, group=group)   # each rank fills its own slot: a gather
    ids_list = ids.tolist()
    mine = [r for r in range(world) if ids_list[r] == ids_list[rank]].index(rank)
    turns = max(ids_list.count(v) for v in set(ids_list))
    rounds = []
    with _ComputeRounds(device) as timer:
        for _ in range(COMPUTE_ROUNDS):
            for turn in range(turns):
                if turns > 1:
                    dist.barrier(group=group)
                if turn == mine:
                    rounds.append(timer.round())
    return COMPUTE_ROUNDS * min(rounds)


def run_probe(group: Any, rank: int, world: int, device: Any = None) -> tuple[list[float], list[float]]:
    """Collective over ``group``: (compute seconds per rank on ``device``, round-trip
    seconds of each ring edge: ``edges[r]`` between ranks ``r`` and ``r + 1``)."""
    import torch
    import torch.distributed as dist

    mine = torch.zeros(2 * world, dtype=torch.float64)
    mine[rank] = _compute_in_turns(group, rank, world, device)
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
