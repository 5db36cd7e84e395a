"""A multi-member etcd cluster on loopback: what a fleet runs (three or five members), here.

Why: the faults of a real control plane are a cluster's faults — a member lost, or a
majority lost (no quorum: every write and linearizable read fails until a majority is
back, while the surviving member still accepts connections). The tests, the chaos
harness (its ``etcd-loss`` kind) and the control-plane simulator (bench/scale.py) start
one of these where the one-member embedded etcd would hide those faults.

Each member is an :class:`~resilient.etcd.server.EmbeddedEtcd` (its own data dir, log,
pdeathsig, cleanup), given a shared ``--initial-cluster`` on ports chosen before any
starts. They are started together, from threads: a member's health check needs a
quorum, so a sequential start would wait on members that do not exist yet. A member's
``stop()``/``start()`` keep its ports and data (restarting one member of a majority-less
cluster restores the quorum as soon as a majority runs again).
"""

from __future__ import annotations

import threading
from datetime import timedelta

from resilient.etcd.api import EtcdError
from resilient.etcd.server import EmbeddedEtcd, free_port

__all__ = ["EtcdCluster"]

_JOIN_SLACK = timedelta(seconds=5)


class EtcdCluster:
    """``members`` (1, 3 or 5) etcd servers forming one cluster; ``quota``: the backend
    quota in bytes (``None``: etcd's default, 2 GiB). One member is the plain embedded
    server. Use as a context manager, or :meth:`start` and :meth:`close`."""

    def __init__(self, members: int = 3, host: str = "127.0.0.1", quota: int | None = None,
                 start_timeout: timedelta = timedelta(seconds=30)) -> None:
        if members not in (1, 3, 5):
            raise EtcdError(f"an etcd cluster of {members} members: use 1, 3 or 5 (an odd number: a majority decides)")
        self.host, self.start_timeout = host, start_timeout
        self.members: list[EmbeddedEtcd] = []
        names = [f"m{i}" for i in range(members)]
        ports = [(free_port(host), free_port(host)) for _ in names] if members > 1 else []
        cluster = ",".join(f"{n}=http://{host}:{p}" for n, (_, p) in zip(names, ports))
        common = [f"--quota-backend-bytes={quota}"] if quota else []
        for i, name in enumerate(names):
            # a cluster's raft needs more slack than one member's: 500 ms elections on a busy host
            extra = [f"--initial-cluster={cluster}", "--heartbeat-interval=50", "--election-timeout=500"] if members > 1 else []
            m = EmbeddedEtcd(host=host, name=name, start_timeout=start_timeout, extra_args=extra + common)
            if members > 1:
                m.client_port, m.peer_port = ports[i]
            self.members.append(m)

    # ------------------------------------------------------------ addresses
    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self) -> str:
        """``host:port,host:port,...``: the ``--rdzv-endpoint`` form."""
        return ",".join(self.endpoints)

    @property
    def client_urls(self) -> list[str]:
        return [m.client_url for m in self.members]

    @property
    def metrics_url(self) -> str:
        return self.members[0].client_url + "/metrics"

    @property
    def ports(self) -> list[int]:
        return [p for m in self.members for p in (m.client_port, m.peer_port)]

    def pids(self) -> list[int]:
        return [m.pid for m in self.members if m.running() and m.pid is not None]

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "EtcdCluster":
        """Start every member (together) and wait until each is healthy."""
        errors: list[BaseException] = []

        def one(m: EmbeddedEtcd) -> None:
            try:
                m.start()
            except BaseException as e:  # reported below, after every thread ended
                errors.append(e)

        threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join((self.start_timeout + _JOIN_SLACK).total_seconds())
        if errors or any(t.is_alive() for t in threads):
            self.close()
            raise errors[0] if errors else EtcdError(
                f"etcd cluster of {len(self.members)} did not start within {self.start_timeout}")
        return self

    def close(self) -> None:
        for m in self.members:
            m.close()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
