"""etcd for the control-plane simulator (bench/scale.py): etcd's own counters from its
``/metrics`` endpoint (the cluster itself: :class:`resilient.etcd.cluster.EtcdCluster`).

Why etcd's counters and not our own count: what an operator sizes is the load etcd sees
(puts inside transactions, ranges, lease keep-alives, database growth), whatever client
sends it; a client-side count would miss retries, torch's own store traffic and anything
the simulator forgot to count.
"""

from __future__ import annotations

import re
import urllib.request
from datetime import timedelta


# etcd_mvcc_* in etcd >= 3.5, etcd_debugging_mvcc_* before: both are read, the first found wins.
COUNTERS = {
    "put": ("etcd_mvcc_put_total", "etcd_debugging_mvcc_put_total"),
    "txn": ("etcd_mvcc_txn_total", "etcd_debugging_mvcc_txn_total"),
    "range": ("etcd_mvcc_range_total", "etcd_debugging_mvcc_range_total"),
    "delete": ("etcd_mvcc_delete_total", "etcd_debugging_mvcc_delete_total"),
    "db_bytes": ("etcd_mvcc_db_total_size_in_bytes", "etcd_debugging_mvcc_db_total_size_in_bytes"),
    "db_in_use": ("etcd_mvcc_db_total_size_in_use_in_bytes",),
    "rx_bytes": ("etcd_network_client_grpc_received_bytes_total",),
    "tx_bytes": ("etcd_network_client_grpc_sent_bytes_total",),
}
_GRPC = re.compile(r'^grpc_server_msg_received_total\{grpc_method="(\w+)".*\}\s+([0-9.e+]+)$')


def scrape(metrics_url: str, timeout: timedelta = timedelta(seconds=5)) -> dict[str, float]:
    """etcd's counters (see :data:`COUNTERS`) and its gRPC messages received per method
    (``grpc.<Method>``: the JSON gateway turns every request into one), now."""
    with urllib.request.urlopen(metrics_url, timeout=timeout.total_seconds()) as r:
        text = r.read().decode()
    raw: dict[str, float] = {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _GRPC.match(line)
        if m:
            out[f"grpc.{m.group(1)}"] = out.get(f"grpc.{m.group(1)}", 0.0) + float(m.group(2))
            continue
        name, _, value = line.rpartition(" ")
        if "{" not in name:
            try:
                raw[name] = float(value)
            except ValueError:
                pass
    for key, names in COUNTERS.items():
        out[key] = next((raw[n] for n in names if n in raw), 0.0)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counter increments between two scrapes (gauges such as db_bytes: their change)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}


def writes(d: dict[str, float]) -> float:
    """Keys written (puts, also those inside transactions) and deleted: what etcd logs and fsyncs."""
    return d.get("put", 0.0) + d.get("delete", 0.0)


def requests(d: dict[str, float]) -> float:
    """Requests etcd served (every gRPC message received: KV, lease keep-alives, grants...)."""
    return sum(v for k, v in d.items() if k.startswith("grpc."))
