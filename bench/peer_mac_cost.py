"""CPU per GB of the peer channel's payload MACs (a hand tool, for A/B across commits).

Every frame on the peer channel carries an HMAC-SHA256 tag (``resilient.snapshot.peer``):
one more pass over every byte on each side. This measures, over loopback between two
node stores in /dev/shm (both ends in this process, so process CPU is both sides):

* ``mac_only_cpu_s_per_gb``: the tag computation alone, 4 MiB pieces (one side);
* ``put_cpu_s_per_gb``: a whole ``put_file`` (sendfile + MAC on the sender, receive
  into the store's mapping + CRC + MAC on the receiver);
* ``get_cpu_s_per_gb``: a whole ``get`` of the same file (send + MAC, receive + MAC).

Run the same script against another checkout (``PYTHONPATH=...``) to see what the MACs
add; an old checkout has no MAC, so its ``mac_only`` row is still this machine's HMAC
speed, while its put/get rows are the channel without it.

    python bench/peer_mac_cost.py [--mb 512] [--reps 4]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import resilient
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PIECE, PeerClient, PeerServer

SECRET = b"s" * 32
REL = "step-000000000001/abc-000001/r00000-p0000.bin"


def _median_per_gb(samples: list[float], nbytes: int) -> float:
    return round(statistics.median(samples) / (nbytes / 1e9), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=512, help="size of the file pushed and pulled")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)
    nbytes = args.mb << 20
    base = Path(tempfile.mkdtemp(prefix="peer-mac-cost-", dir="/dev/shm"))
    a, b = NodeStore(base, "job", "a"), NodeStore(base, "job", "b")
    a.create(), b.create()
    srv = PeerServer(b, SECRET, host="127.0.0.1")
    try:
        src = a.file(REL)
        src.parent.mkdir(parents=True, exist_ok=True)
        with open(src, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        data = memoryview(src.read_bytes())
        mac_only = []
        for _ in range(args.reps):
            c0 = time.process_time()
            for i in range(0, nbytes, PIECE):
                hmac.new(SECRET, data[i:i + PIECE], hashlib.sha256).digest()
            mac_only.append(time.process_time() - c0)
        put, get, wall_put = [], [], []
        with PeerClient(srv.address, SECRET) as c:
            for _ in range(args.reps):
                b.retain(set(), below=10)
                c0, w0 = time.process_time(), time.perf_counter()
                c.put_file(REL, src)
                put.append(time.process_time() - c0)
                wall_put.append(time.perf_counter() - w0)
            for _ in range(args.reps):
                c0 = time.process_time()
                got = c.get(REL)
                get.append(time.process_time() - c0)
                assert len(got) == nbytes
                del got
        print(json.dumps({"code": str(Path(resilient.__file__).parent.parent), "mb": args.mb, "reps": args.reps,
                          "mac_only_cpu_s_per_gb": _median_per_gb(mac_only, nbytes),
                          "put_cpu_s_per_gb": _median_per_gb(put, nbytes),
                          "get_cpu_s_per_gb": _median_per_gb(get, nbytes),
                          "put_wall_s_per_gb": _median_per_gb(wall_put, nbytes)}))
    finally:
        srv.close()
        a.remove(), b.remove()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
