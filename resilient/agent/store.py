"""The agent's node store service: shared-memory store, peer server, replicator.

Owned by the agent because it must outlive workers: created before the first
worker starts (reclaiming trees of this job left by agents that were killed),
advertised in the node registry (``store`` = HOST:PORT of its peer server),
handed to workers through the ``RESILIENT_STORE`` environment variable, and
removed when the agent leaves. The job secret that authenticates peers and
etcd records never passes through etcd: the agent has it from outside
(:mod:`resilient.secret`) and gives it to its workers as a 0600 file in its
private temporary directory, named in ``RESILIENT_STORE``.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from resilient.agent.membership import RegistryReader
from resilient.secret import JobSecret, require_secret
from resilient.snapshot.api import SnapshotError
from resilient.snapshot.format import version_dir
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerServer
from resilient.snapshot.storefull import full_since
from resilient.snapshot.storeroot import reclaim_run
from resilient.contract import STORE_ENV
from resilient.snapshot.tiers import StoreInfo

log = logging.getLogger(__name__)


def kept_versions(store: NodeStore) -> list[dict]:
    """What an adopted tree holds, for the registry: ``{"step", "attempt", "world", "ranks"}`` per
    version. The world is read from a rank manifest unchecked: a hint to plan with; a restore
    authenticates every manifest and chunk it reads."""
    out = []
    for v in getattr(store, "adopted", []):
        try:
            rel = f"{version_dir(v.step)}/{v.attempt}/r{min(v.ranks):05d}.json"
            world = json.loads(store.read(rel)).get("world")
        except (OSError, ValueError, AttributeError, SnapshotError):
            continue
        if isinstance(world, int) and world > 0:
            out.append({"step": v.step, "attempt": v.attempt, "world": world, "ranks": sorted(v.ranks)})
    return out[-4:]  # the newest few: a restore wants the newest complete one


RUN_OVER = ("finished", "rendezvous_closed")  # an agent's stop reasons that mean the run is done


@dataclass
class StoreSettings:
    """From the ``[snapshot]`` config: see :class:`resilient.snapshot.config.SnapshotConfig`."""

    base: str = "/dev/shm"
    replicas: int = 1
    keep: int = 2
    rate_bytes_s: float = 0.0
    host: str = ""   # snapshot.store_host: "" = the address peers are told (resilient.snapshot.peer)
    duty: float = 0.1
    max_stride: int = 1
    commit: str = "leader"   # as SnapshotConfig.commit; launch.store_settings passes it


class NodeStoreService:
    def __init__(self, settings: StoreSettings, run_id: str, node: str, endpoint: str,
                 client_factory: Callable[[], Any], private_dir: Path, events: Any,
                 etcd_conf: dict[str, str] | None = None, secret: JobSecret | bytes | None = None):
        self.run_id, self.node, self.endpoint, self.events = run_id, node, endpoint, events
        # First: a node without the job secret must fail before it creates anything.
        secret = JobSecret.of(secret) if secret is not None else require_secret(what="the node store")
        self.store = NodeStore(settings.base, run_id, node)
        reclaimed = self.store.create()
        if reclaimed:
            log.warning("reclaimed node stores that dead agents left on this machine: %s", reclaimed)
        self.kept = kept_versions(self.store)
        if self.kept:
            events.emit("store_adopted", path=str(self.store.path), steps=sorted({k["step"] for k in self.kept}))
        self.client = client_factory()
        self.secret = secret
        self._registry = RegistryReader(self.client, run_id, secret, events)
        self.secret_file = private_dir / "job.secret"
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret.material.hex())  # hex: the material may be any bytes
        self.server = PeerServer(self.store, secret, settings.host)
        self.replicator = Replicator(
            self.store, self.client, run_id, node, secret, self.live_nodes,
            ReplicatorOptions(k=settings.replicas, keep=settings.keep, rate=settings.rate_bytes_s,
                              duty=settings.duty, max_stride=settings.max_stride, protocol=settings.commit),
            events)
        self.replicator.serve(self.server)  # it collects its peers' holds when it leads a commit
        self._full_seen = 0.0        # the time of the last full-store warning already reported
        self._next_full_check = 0.0
        self.info = StoreInfo(base=str(settings.base), run_id=run_id, node=node, etcd=endpoint,
                              secret_file=str(self.secret_file), etcd_conf=dict(etcd_conf or {}))

    def registry_info(self) -> dict:
        """This node's store in its registry entry: the peer address, and the versions an adopted
        tree holds (``kept``), which restores may use (:func:`~resilient.snapshot.tiers.memory_plan`)."""
        return {"store": self.server.address, **({"kept": self.kept} if self.kept else {})}

    def live_nodes(self) -> dict[str, dict] | None:
        try:
            return self._registry()
        except Exception as e:  # unknown is not dead
            log.debug("node registry unreachable: %s", e)
            return None

    def env(self) -> dict[str, str]:
        """What each worker's environment gets: the store, and the etcd password when the agent
        logs in to etcd (a ``--rdzv-conf`` password, or the embedded etcd's, derived from the job
        secret: ``resilient.launch.etcd_endpoint``). In the environment, never in argv nor in
        ``RESILIENT_STORE``; given with each assignment, not only inherited, because a warm
        zygote started before the agent knew it (``resilient.agent.warm.start_early``) lacks it."""
        from resilient.rendezvous.registry import PASSWORD_ENV

        # The etcd endpoints this agent's client knows now: an embedded etcd grown into a cluster
        # since the agent started (resilient.control.members) may have lost its first member.
        known = self.client.endpoint_list()
        info = dataclasses.replace(self.info, etcd=known) if known else self.info
        env = {STORE_ENV: info.to_env()}
        password = os.environ.get(PASSWORD_ENV)
        if password is not None and (self.info.etcd_conf.get("username") or self.info.etcd_conf.get("user")):
            env[PASSWORD_ENV] = password
        return env

    def report_full(self, interval: float = 1.0) -> None:
        """A ``store_full`` event each time a rank of this node warned that the store is full
        (:mod:`resilient.snapshot.storefull`: at most once a minute); checked every ``interval`` s.
        Here, not in the ranks: the store is the agent's, and the event is the node's."""
        now = time.monotonic()
        if now < self._next_full_check:
            return
        self._next_full_check = now + interval
        warned = full_since(self.store.path, self._full_seen)
        if warned is None:
            return
        self._full_seen = warned
        try:
            free = self.store.free_bytes()
        except OSError:
            free = 0
        kept = [v.step for v in self.store.versions()]
        self.events.emit("store_full", path=str(self.store.path), free_bytes=free, newest_kept=max(kept, default=None),
                         fix="enlarge /dev/shm (or the filesystem of snapshot.store_dir) or lower snapshot.store_keep")

    def set_workers(self, ranks: set[int], world: int) -> None:
        self.world = world
        self.replicator.set_workers(ranks, world)

    def make_durable(self, url: str, timeout: timedelta = timedelta(seconds=60)) -> int | None:
        """Copy the newest version this store holds whole (every rank of the last round's world:
        its own shards and its peers' replicas) to the durable tier at ``url`` and commit it there
        as the workers' committer does (each rank manifest's MAC checked, the global manifest signed
        last). For a node whose control plane is gone (its workers died with a peer): what the
        job committed in RAM must not be lost with the node. Returns the step made durable, or
        None when no version is whole here (its ranks are on other nodes) or the copy failed."""
        import fsspec

        from resilient.snapshot.auth import VersionAuth
        from resilient.snapshot.durable import Committer, DurableOptions

        world = getattr(self, "world", 0)
        whole = [v for v in self.store.versions() if world and v.ranks >= set(range(world))]
        if not whole:
            return None
        v = whole[-1]
        fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/")
        adir = f"{version_dir(v.step)}/{v.attempt}"
        try:
            fs.makedirs(f"{root}/{adir}", exist_ok=True)
            names = sorted(os.listdir(self.store.path / adir), key=lambda n: n.endswith(".json"))  # manifests last
            for name in names:
                if name.endswith((".bin", ".json")):
                    fs.put_file(str(self.store.path / adir / name), f"{root}/{adir}/{name}")
            committer = Committer(fs, root, world, DurableOptions(), self.events, url, VersionAuth(self.secret))
            try:
                committer.add(v.step, v.attempt)
                committer.wait_idle(timeout)
            finally:
                committer.close(timedelta(seconds=1))
        except Exception as e:  # nothing to lose by trying: the node store keeps the version too
            log.warning("could not make step %d durable at %s: %s", v.step, url, e)
            return None
        return v.step if committer.committed == v.step else None

    def flush(self, timeout: timedelta) -> bool:
        return self.replicator.flush(timeout)

    def close(self, stop_reason: str | None = "finished") -> None:
        """Stop serving; what happens to the tree depends on why the agent stops (its
        ``stop_reason``): the run is over (:data:`RUN_OVER`): it goes, and so do the trees this
        run's dead agents left on this machine; quarantined: it goes (its bytes are suspect);
        any other stop leaves the run unfinished: it is kept for a relaunch of this node, which
        adopts it (:mod:`resilient.snapshot.storeroot` bounds how long)."""
        self.replicator.close()
        self.server.close()
        try:
            self.client.close()
        except Exception:
            pass
        if stop_reason in RUN_OVER:
            reclaim_run(self.store.base, self.run_id, but=self.node)
        elif stop_reason != "quarantined":
            self.store.keep(stop_reason or "unknown")
            return
        self.store.remove()
