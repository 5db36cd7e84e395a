"""CPU of one replica push between two node stores (a hand tool, for A/B across commits).

The ``overhead`` row measures snapshots + replication inside a training job, where
the CPU of the agents' pushes (a few ms per version) drowns in the run-to-run swing
of the workers' CPU on these shared cores. This isolates it: one rank's version of
``--mb`` MB written by a real Snapshotter into node store A, pushed by the agent's
own push code (``Replicator._push``: rank manifest, part CRCs, ``sendfile``) to a
real ``PeerServer`` on store B over loopback, then retired on B so the next push
rewrites spares, as a running agent does. Between pushes a 64 MB buffer is
rewritten, so the caches are as cold as after a training step. Reported: median
process CPU (both ends: they share this process) and wall time per push.

Beside it, the worker's side of every version (``write_cpu_ms``): the same
Snapshotter capturing the state again and writing it into store A (capture on
the calling thread, CRCs and the write on its writer threads), the older
version retired to spares first, as the agent's retention does.

    python bench/push_cost.py [--mb 7] [--reps 40]
    PYTHONPATH=/path/to/other/checkout python bench/push_cost.py   # the same, another commit
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import resilient
from resilient.snapshot import Snapshotter
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerServer

SECRET = b"s" * 32


def measure(mb: float, reps: int) -> dict:
    """The push and the rank's side of one version of ``mb`` MB, medians over ``reps``:
    ``cpu_ms`` / ``wall_ms`` of a push (both ends), ``write_cpu_ms`` of the rank's save and
    write into its store, split into ``capture_cpu_ms`` (until ``save`` returns: the training
    thread's copy) and the rest (the writer threads: CRCs, chunk MACs, the store's files)."""
    torch.set_num_threads(1)  # idle OpenMP workers spin after the cache-clearing fill: CPU not ours
    base = Path(tempfile.mkdtemp(prefix="push-cost-", dir="/dev/shm"))
    a, b = NodeStore(base, "job", "a"), NodeStore(base, "job", "b")
    a.create(), b.create()
    srv = PeerServer(b, SECRET, host="127.0.0.1")
    # The agent's push code, without its thread and etcd: only what _push reads.
    rep = Replicator.__new__(Replicator)
    rep.store, rep.secret, rep.opts, rep._clients = a, SECRET, ReplicatorOptions(), {}
    try:
        n = int(mb * (1 << 20)) // 4
        state = {f"t{i}": torch.randn(n // 96 + (i < n % 96)) for i in range(96)}  # demo-like: 96 tensors
        junk = torch.empty(16 << 20)
        writes, captures = [], []
        # As TrainState writes a node store: signed where the checkout signs versions (its chunk
        # MACs are part of the capture's cost), so an A/B against an older checkout compares both.
        signs = "secret" in inspect.signature(Snapshotter).parameters
        with Snapshotter(a.url, every=1, commit=False, compress="none", **({"secret": SECRET} if signs else {})) as snap:
            for i in range(reps + 3):
                a.retain({i}, below=i)
                junk.fill_(float(i))
                c0 = time.process_time()
                snap.save(i + 1, state)
                c1 = time.process_time()
                assert snap.wait()
                writes.append(time.process_time() - c0)
                captures.append(c1 - c0)
        a.retain({reps + 3}, below=reps + 3)
        version = a.versions()[-1]
        cpu, wall = [], []
        for i in range(reps + 2):
            b.retain(set(), below=version.step)
            junk.fill_(float(i))
            c0, w0 = time.process_time(), time.perf_counter()
            sent = rep._push("b", srv.address, version, sorted(version.ranks))
            if i >= 2:  # the first pushes create B's files; later ones rewrite spares
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
        ms = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
        return {"code": str(Path(resilient.__file__).parent.parent), "bytes": sent, "reps": reps,
                "cpu_ms": ms(cpu), "write_cpu_ms": ms(writes[3:]), "capture_cpu_ms": ms(captures[3:]),
                "wall_ms": ms(wall), "cpu_ms_all": [round(x * 1e3, 3) for x in cpu],
                "write_cpu_ms_all": [round(x * 1e3, 3) for x in writes[3:]],
                "capture_cpu_ms_all": [round(x * 1e3, 3) for x in captures[3:]]}
    finally:
        for c in rep._clients.values():
            c.close()
        srv.close()
        a.remove(), b.remove()
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=7.0, help="state of the rank (the demo: ~7 MB per rank)")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    got = measure(args.mb, args.reps)
    print(json.dumps({k: v for k, v in got.items() if not k.endswith("_all")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
