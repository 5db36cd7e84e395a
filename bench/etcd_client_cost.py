"""Client and server CPU per etcd request, as the snapshot replicator makes them (not a row of
RESULTS.md: the reason resilient/etcd/transport.py exists, reproducible).

    python bench/etcd_client_cost.py

Starts a real etcd on loopback, runs each request kind 600 times after 50 warm-ups and
prints this process's CPU and etcd's (psutil) per request, for ``EtcdClient`` and for a
bare ``http.client`` connection (the floor of the JSON gateway from Python). Three etcds,
side by side (``--rounds`` times, alternating): without authentication; with a root password
(every request carries a token etcd checks: the embedded etcd before issue 39); and as
``resilient launch`` runs its embedded etcd now: that password plus client TLS (certificates
derived from a job secret, required on the client port). The ``reconnecting`` row opens a new
connection for each request (the TLS handshake: what a short-lived tool, or a new thread's
first request, pays).

    python bench/etcd_client_cost.py --rounds 2
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import ssl
import tempfile
import time

import psutil

from resilient.etcd.server import EmbeddedEtcd

N = 600


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


MODES = {"none": "without authentication",
         "password": "with authentication (root, token per request)",
         "password+tls": "with authentication and client TLS (resilient launch's embedded etcd)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="times each mode is measured, alternating")
    args = ap.parse_args()
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else reversed(list(MODES))):
            print(f"[round {r + 1}] {MODES[mode]}")
            measure(mode)


def measure(mode: str) -> None:
    from resilient.etcd.pki import derive_tls

    password = None if mode == "none" else "bench-root-password-" + "x" * 32
    tls = derive_tls(b"bench secret " * 3, tempfile.mkdtemp(), server=True) if mode == "password+tls" else None
    with EmbeddedEtcd(root_password=password, tls=tls) as srv:
        etcd = psutil.Process(srv.pid)
        c = srv.client()

        def run(label, fn):
            for i in range(50):
                fn(i)
            s0, c0, w0 = etcd.cpu_times(), time.process_time(), time.perf_counter()
            for i in range(N):
                fn(i)
            s1, c1, w1 = etcd.cpu_times(), time.process_time(), time.perf_counter()
            server = (s1.user + s1.system) - (s0.user + s0.system)
            print(f"{label:28s} client {1e3 * (c1 - c0) / N:.2f} ms CPU, etcd {1e3 * server / N:.2f} ms CPU, "
                  f"wall {1e3 * (w1 - w0) / N:.2f} ms")

        run("EtcdClient hold txn", lambda i: c.put_and_get_prefix(
            f"/x/h/{i:012d}/a", "v" * 200, f"/x/h/{i:012d}/", newest_under=["/x/c/local/", "/x/c/memory/"]))
        run("EtcdClient commit txn", lambda i: c.create_all({f"/x/c/local/{i:012d}": "v" * 300,
                                                            f"/x/c/memory/{i:012d}": "v" * 300}))
        run("EtcdClient get", lambda i: c.get("/x/h/000000000001/a"))

        def reconnecting(i):
            c._gw[0]._forget()   # the next request opens a new connection (TLS: a new handshake)
            c.get("/x/h/000000000001/a")

        run("EtcdClient get reconnecting", reconnecting)
        if tls is not None:
            ctx = ssl.create_default_context(cafile=str(tls.ca))
            ctx.load_cert_chain(str(tls.client_cert), str(tls.client_key))
            conn = http.client.HTTPSConnection(srv.host, srv.client_port, context=ctx)
        else:
            conn = http.client.HTTPConnection(srv.host, srv.client_port)
        headers = {"Content-Type": "application/json"}

        def raw(path: str, body: dict) -> dict:
            conn.request("POST", path, json.dumps(body), headers)
            return json.loads(conn.getresponse().read())

        if password:
            headers["Authorization"] = raw("/v3/auth/authenticate", {"name": "root", "password": password})["token"]

        run("bare http.client txn", lambda i: raw("/v3/kv/txn", {"compare": [], "success": [
            {"request_put": {"key": b64(f"/y/{i}"), "value": b64("v" * 200)}},
            {"request_range": {"key": b64(f"/y/{i}")}}]}))
        run("bare http.client get", lambda i: raw("/v3/kv/range", {"key": b64("/y/1")}))
        c.close()


if __name__ == "__main__":
    main()
