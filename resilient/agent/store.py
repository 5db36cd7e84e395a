"""The agent's node store service: shared-memory store, peer server, replicator.

Owned by the agent because it must outlive workers: created before the first
worker starts (reclaiming trees of this job left by agents that were killed),
advertised in the node registry (``store`` = HOST:PORT of its peer server),
handed to workers through the ``RESILIENT_STORE`` environment variable, and
removed when the agent leaves. The job secret that authenticates peers is
created once per job in etcd (``/resilient/<run>/secret``) and given to the
workers as a 0600 file in the agent's private temporary directory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from resilient.snapshot.memcommit import Replicator, ReplicatorOptions
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerServer, job_secret
from resilient.snapshot.tiers import STORE_ENV, StoreInfo

log = logging.getLogger(__name__)


@dataclass
class StoreSettings:
    """From the ``[snapshot]`` config: see :class:`resilient.snapshot.config.SnapshotConfig`."""

    base: str = "/dev/shm"
    replicas: int = 1
    keep: int = 2
    rate_bytes_s: float = 0.0
    host: str = "0.0.0.0"
    duty: float = 0.1
    max_stride: int = 1


class NodeStoreService:
    def __init__(self, settings: StoreSettings, run_id: str, node: str, endpoint: str,
                 client_factory: Callable[[], Any], private_dir: Path, events: Any,
                 etcd_conf: dict[str, str] | None = None):
        self.run_id, self.node, self.endpoint, self.events = run_id, node, endpoint, events
        self.store = NodeStore(settings.base, run_id, node)
        reclaimed = self.store.create()
        if reclaimed:
            log.warning("reclaimed stale node stores of this job: %s", reclaimed)
        self.client = client_factory()
        secret = job_secret(self.client, run_id)
        self.secret_file = private_dir / "job.secret"
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex())
        self.server = PeerServer(self.store, secret, settings.host)
        self.replicator = Replicator(
            self.store, self.client, run_id, node, secret, self.live_nodes,
            ReplicatorOptions(k=settings.replicas, keep=settings.keep, rate=settings.rate_bytes_s,
                              duty=settings.duty, max_stride=settings.max_stride), events)
        self.info = StoreInfo(base=str(settings.base), run_id=run_id, node=node, etcd=endpoint,
                              secret_file=str(self.secret_file), etcd_conf=dict(etcd_conf or {}))

    def live_nodes(self) -> dict[str, dict] | None:
        try:
            kvs = self.client.get_prefix(f"/resilient/{self.run_id}/nodes/")
        except Exception as e:  # unknown is not dead
            log.debug("node registry unreachable: %s", e)
            return None
        out = {}
        for kv in kvs:
            try:
                doc = json.loads(kv.value)
                out[doc["node"]] = doc
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def env(self) -> dict[str, str]:
        return {STORE_ENV: self.info.to_env()}

    def set_workers(self, ranks: set[int], world: int) -> None:
        self.replicator.set_workers(ranks, world)

    def flush(self, timeout: timedelta) -> bool:
        return self.replicator.flush(timeout)

    def close(self) -> None:
        self.replicator.close()
        self.server.close()
        try:
            self.client.close()
        except Exception:
            pass
        self.store.remove()
