"""One process of the control-plane simulator (bench/scale.py): a slice of the fleet's
simulated nodes, each a set of threads running the agent's real control plane and nothing
else (no torch workers):

* the real ``etcd3`` rendezvous handler and backend (torch's ``DynamicRendezvousHandler``
  through :func:`resilient.rendezvous.create_etcd3_handler`), with its own etcd client
  and liveness lease, as an agent process has;
* the node registry entry (its own lease) and the quarantine check at start;
* a node store (tmpfs), its authenticated peer server, and the real replicator
  (:class:`~resilient.snapshot.memcommit.Replicator`): each version is one tiny rank
  (one row of a ``(world, 4)`` tensor) pushed to ``k`` peers and committed through
  the real protocol.

The parent drives every process through a pipe with one command at a time (``join``,
``kill``, ``reform``, ``version``, ``close``) and gets per-node results back; nodes of
one process run each command in parallel threads, as separate agents would. A killed
node behaves as one killed with -9: its peer port refuses connections at once, its
keep-alives stop, its keys stay until their leases lapse.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from resilient.agent.membership import NodeRegistry, RegistryReader, exchange_node_ids
from resilient.agent.quarantine import Quarantine
from resilient.snapshot.api import ChunkRecord, Manifest, TensorRecord
from resilient.snapshot.auth import VersionAuth
from resilient.snapshot.format import checksum, crc, manifest_to_json, version_dir
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions
from resilient.snapshot.nodestore import Doorbell, NodeStore
from resilient.snapshot.peer import PeerServer

COLS = 4


def write_rank(store: NodeStore, step: int, attempt: str, rank: int, world: int, secret) -> None:
    """Rank ``rank``'s part and manifest of version ``step``: row ``rank`` of a ``(world, COLS)``
    float32 tensor, so the world's manifests tile it exactly (the replicator checks that),
    signed with the job ``secret`` as a worker signs it (the replicator spreads nothing else)."""
    auth = VersionAuth(secret)
    data = struct.pack(f"<{COLS}f", *(float(rank * COLS + c) for c in range(COLS)))
    obj = f"{attempt}/r{rank:05d}-p0000.bin"
    for rel, blob in ((f"{version_dir(step)}/{obj}", data),):
        w = store.writer(rel)
        w.write(blob)
        w.commit(len(blob), crc(blob))
    chunk = ChunkRecord(obj, 0, len(data), len(data), (rank, 0), (1, COLS), checksum(data),
                        mac=auth.chunk_mac(step, attempt, data))
    m = Manifest(step=step, world=world, layout={"dp": world}, config_digest="scale", attempt=attempt,
                 tensors={"w": TensorRecord("w", (world, COLS), "float32", [chunk])}, rank_extras={rank: None},
                 created=time.time(), rank=rank)
    doc = auth.sign_manifest(manifest_to_json(m))
    w = store.writer(f"{version_dir(step)}/{attempt}/r{rank:05d}.json")
    w.write(doc)
    w.commit(len(doc), crc(doc))


class Errors:
    """The replicator's event sink: counts ``upload_error`` events and keeps the first few,
    for the parent's report (the simulator writes no event log)."""

    def __init__(self) -> None:
        self.count, self.first = 0, []

    def emit(self, kind: str, **fields: Any) -> None:
        if kind == "upload_error":
            self.count += 1
            if len(self.first) < 3:
                self.first.append(fields)


class SimNode:
    """One simulated agent. ``conf``: the ``--rdzv-conf`` keys, as strings."""

    def __init__(self, name: str, domain: str, cfg: dict[str, Any]) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from resilient.rendezvous import create_etcd3_handler
        from resilient.rendezvous.keyed import KeyedRendezvousHandler

        self.name, self.alive = name, True
        self.errors = Errors()
        self.rank = self.world = -1
        self.round = -1
        params = RendezvousParameters(backend="etcd3", endpoint=cfg["endpoint"], run_id=cfg["run_id"],
                                      min_nodes=cfg["min_nodes"], max_nodes=cfg["max_nodes"],
                                      local_addr="127.0.0.1", **cfg["conf"])
        self.handler = create_etcd3_handler(params)
        # torch's handler keeps its etcd parts in its backend; the keyed one holds them itself.
        self.keyed = isinstance(self.handler, KeyedRendezvousHandler)
        parts = self.handler if self.keyed else self.handler._state_holder._backend
        self.client, self.rdzv_lease, secret = parts.client, parts.lease, parts.secret
        self.secret = secret
        Quarantine(self.client, cfg["run_id"], secret).refuse_if_quarantined(name, cfg["endpoint"])
        self.registry = NodeRegistry(self.client, cfg["run_id"], name, domain,
                                     timedelta(seconds=float(cfg["conf"].get("lease_ttl", 10))), secret)
        self.store = NodeStore(cfg["shm"], cfg["run_id"], name)
        self.store.create()
        self.server = PeerServer(self.store, secret, host="127.0.0.1")
        self.registry.claim(store=self.server.address, rdzv=self.handler.node_desc)
        self.replicator = Replicator(self.store, self.client, cfg["run_id"], name, secret,
                                     RegistryReader(self.client, cfg["run_id"], secret),
                                     ReplicatorOptions(k=cfg["k"], duty=0.0, protocol=cfg["protocol"],
                                                       gather_timeout=timedelta(seconds=cfg["gather_timeout"])),
                                     self.errors)
        self.replicator.serve(self.server)

    def settings(self, **changes: Any) -> None:
        """Change torch's rendezvous settings from now on (it keeps one frozen object in three
        places). ``min_nodes``: the first round runs with ``MIN = MAX`` (all nodes start
        together and every one is admitted, none left on a wait list by the last call), the
        re-forms with room for the lost. ``keep_alive_interval`` (seconds): long while the
        versions are measured, so that their etcd writes are the commit protocol's alone
        (the keep-alives' own load is measured apart, idle)."""
        h = self.handler
        if self.keyed:  # no keep-alive writes (its liveness is the etcd lease); the rest is its own
            if "min_nodes" in changes:
                h.settings.min_nodes = changes["min_nodes"]
            return
        if "keep_alive_interval" in changes:
            changes["keep_alive_interval"] = timedelta(seconds=changes["keep_alive_interval"])
        new = dataclasses.replace(h._settings, **changes)
        h._settings = h._state_holder._settings = h._op_executor._settings = new

    def joined(self, info) -> None:
        self.rank, self.world = info.rank, info.world_size
        # As the agent's _join_round: publish our node id in the round's store, learn everyone's.
        ids = exchange_node_ids(info.store, self.rank, self.world, self.name)
        self.round_nodes = set(ids)
        self.registry.know_round(self.handler.members_by_rank(), ids)
        self.round = self.handler._joined[0] if self.keyed else self.handler._state_holder.state.round
        self.replicator.set_workers({self.rank}, self.world)

    def rendezvous(self) -> float:
        """Join the next round; the time the rendezvous itself returned (what follows, the
        round's node-id exchange through its store, is the rest of the re-form)."""
        info = self.handler.next_rendezvous()
        t = time.time()
        self.joined(info)
        return t

    def join(self) -> dict:
        t0 = time.time()
        t_rdzv = self.rendezvous()
        return {"node": self.name, "t0": t0, "t_rdzv": t_rdzv, "t1": time.time(), "rank": self.rank,
                "world": self.world, "round": self.round}

    def reform(self, settle: float, limit: float = 300.0) -> dict:
        """What a surviving agent does when a member is lost: evict the proven dead, join anew;
        then, as its monitor loop does, join again while nodes wait for a seat (a straggler
        the last call left on the wait list), until none has for ``settle`` seconds (or,
        rounds churning, ``limit`` seconds have passed: the parent reports the joins)."""
        t0 = time.time()
        self.handler.evict(self.registry.proven_dead)
        t_rdzv = self.rendezvous()
        t1, joins = time.time(), 1
        quiet, give_up = time.monotonic() + settle, time.monotonic() + limit
        while time.monotonic() < min(quiet, give_up):
            if self.handler.num_nodes_waiting() > 0:
                t_rdzv = self.rendezvous()
                t1, joins = time.time(), joins + 1
                quiet = time.monotonic() + settle
            time.sleep(0.1)
        return {"node": self.name, "t0": t0, "t_rdzv": t_rdzv, "t1": t1, "rank": self.rank, "world": self.world,
                "round": self.round, "joins": joins}

    def version(self, step: int) -> dict:
        write_rank(self.store, step, f"sim{self.round}-{self.round:06d}", self.rank, self.world, self.secret)
        Doorbell.ring(self.replicator._bell.path)  # as a worker does after writing a version
        return {"node": self.name}

    def kill(self) -> None:
        """As kill -9 would: the port refuses at once, keep-alives stop, keys lapse with their leases."""
        self.alive = False
        self.server.close()
        self._stop_heartbeats()
        self.replicator.close(timedelta(seconds=2))
        self.registry.lease.close(revoke=False)
        self.rdzv_lease.close(revoke=False)

    def _stop_heartbeats(self) -> None:
        if not self.keyed:
            self.handler._stop_heartbeats()

    def close(self) -> None:
        try:
            if self.alive:
                self.alive = False
                self.replicator.close(timedelta(seconds=2))
                self.server.close()
                self._stop_heartbeats()
                self.registry.leave()
                self.rdzv_lease.close(revoke=True)
        finally:
            self.client.close()
            self.store.remove()


def _each(nodes: list[SimNode], fn, pool: ThreadPoolExecutor) -> list[dict]:
    def run(n: SimNode) -> dict:
        try:
            return fn(n) or {"node": n.name}
        except Exception as e:  # reported to the parent, which decides
            return {"node": n.name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
    return list(pool.map(run, nodes))


def fleet_main(conn, names: list[str], domains: list[str], cfg: dict[str, Any]) -> None:
    """Entry of one simulator process: build the nodes, then serve the parent's commands."""
    os.environ["RESILIENT_JOB_SECRET"] = cfg["secret"]
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from resilient.rendezvous import register

    register()
    # Every survivor evicts the same dead node: one warning per node and re-form is noise here.
    logging.getLogger("resilient.rendezvous.handler").setLevel(logging.ERROR)
    logging.getLogger("resilient.rendezvous.keyed").setLevel(logging.ERROR)
    nodes: list[SimNode] = []
    pool = ThreadPoolExecutor(max(1, len(names)), thread_name_prefix="sim")
    lock = threading.Lock()
    try:
        def build(i: int) -> dict:
            n = SimNode(names[i], domains[i], cfg)
            with lock:
                nodes.append(n)
            return {"node": n.name}

        got = list(pool.map(lambda i: _safe(build, i, names[i]), range(len(names))))
        conn.send(("ready", got))
        by_name = {}
        while True:
            cmd, arg = conn.recv()
            by_name = {n.name: n for n in nodes}
            live = [n for n in nodes if n.alive]
            if cmd == "join":
                conn.send(("ok", _each(live, SimNode.join, pool)))
            elif cmd == "idle":
                seconds, every = arg
                _idle(live, set(cfg["names"]), seconds, every)
                conn.send(("ok", []))
            elif cmd == "prime":   # every node's first full read of the registry, spread over arg seconds
                for n in live:
                    n.registry.alive()
                    time.sleep(arg / max(1, len(live)))
                conn.send(("ok", []))
            elif cmd == "settings":
                for n in nodes:
                    n.settings(**arg)
                conn.send(("ok", []))
            elif cmd == "reform":
                conn.send(("ok", _each(live, lambda n: n.reform(*arg), pool)))
            elif cmd == "version":
                conn.send(("ok", _each(live, lambda n: n.version(arg), pool)))
            elif cmd == "kill":
                for name in arg:
                    by_name[name].kill()
                conn.send(("ok", [{"node": name} for name in arg]))
            elif cmd == "errors":  # the replicators' upload errors: how many, the first few
                conn.send(("ok", [{"node": n.name, "count": n.errors.count, "first": n.errors.first}
                                  for n in nodes if n.errors.count]))
            elif cmd == "committed":  # the newest commit per tier any node of ours has seen
                best: dict[str, int] = {}
                for n in live:
                    for t, s in n.replicator.committed.items():
                        best[t] = max(best.get(t, -1), s)
                conn.send(("ok", best))
            elif cmd == "close":
                break
    finally:
        _each(nodes, SimNode.close, pool)
        pool.shutdown(wait=False)
        conn.send(("closed", None))


def _idle(nodes: list[SimNode], members: set[str], seconds: float, every: float, monitor: float = 0.1) -> None:
    """A running job's control plane, for ``seconds``: the agents' node-loss check
    (``NodeRegistry.lost``, as ``ResilientAgent`` calls it) by every node every ``every``
    seconds, and torch's agent loop asking each node's handler for waiting nodes at every
    healthy check (``num_nodes_waiting``, every ``monitor`` seconds: launch.monitor_interval)."""
    end = time.monotonic() + seconds
    check = time.monotonic()
    while time.monotonic() < end:
        start = time.monotonic()
        if start >= check:
            check = start + every
            for n in nodes:
                n.registry.lost(members - {n.name}, neighbours=3)
        for n in nodes:
            n.handler.num_nodes_waiting()
        time.sleep(max(0.0, min(monitor - (time.monotonic() - start), end - time.monotonic())))


def _safe(fn, arg, name: str) -> dict:
    try:
        return fn(arg)
    except Exception as e:
        return {"node": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=6)}
