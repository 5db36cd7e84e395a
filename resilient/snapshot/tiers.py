"""Tiered restore: local RAM, then peer RAM, then durable storage.

What a worker under ``resilient launch`` restores from, after any membership
change. Rank 0 reads etcd once: the memory commit records (see
:mod:`.memcommit`: tier ``local`` or ``memory``, each with the holders of
every rank's files) and the live nodes (with their store addresses). A
memory version is a candidate when every rank it was written by still has a
live holder. The durable tier's complete versions are candidates too. The
list, newest step first (memory before durable at the same step), goes to all
ranks as JSON bytes in one broadcast, and :func:`restore_candidates` stages
the first one every rank can read.

Within a memory version, :class:`MemoryReader` builds the global manifest
from the rank manifests and reads each chunk's byte range from its holders in
order: this node's store first (a file read), then peers (a range ``get``
over the authenticated channel). A copy whose CRC does not match is reported
(``restore_fallback`` with ``holder`` and ``copy_skipped: true``) and the
next holder is tried; bad bytes never reach the model. ``served_tier()``
says which tier served this rank: ``local`` if every byte came from its own
node, else ``peer``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from resilient.contract import STORE_ENV
from resilient.events import emit
from resilient.ledger import Copy
from resilient.snapshot.api import Manifest, SnapshotCorrupt, SnapshotError, SnapshotIncomplete, TensorRecord, ChunkRecord
from resilient.snapshot.auth import VersionAuth, report as report_auth
from resilient.snapshot.commits import CommitRecord, abandon_commits_after, read_commits_epoch, run_epoch
from resilient.snapshot.epoch import Epoch
from resilient.snapshot.format import manifest_from_json, merge_rank_manifests, version_dir
from resilient.snapshot.nodestore import NodeStore, rank_of
from resilient.snapshot.peer import PeerClient, PeerError
from resilient.snapshot.reader import SnapshotReader, chunk_view, decode_chunk, open_chunk


@dataclass(frozen=True)
class StoreInfo:
    """What the agent tells its workers about the node store (env ``RESILIENT_STORE``, JSON)."""

    base: str
    run_id: str
    node: str
    etcd: str
    secret_file: str
    # The TLS/auth keys of the agent's --rdzv-conf (ca_cert, cert, key, username, ...), so
    # workers reach a secured etcd as the agent does. Never a password: the workers inherit
    # RESILIENT_ETCD_PASSWORD from the agent's environment.
    etcd_conf: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "StoreInfo | None":
        raw = os.environ.get(STORE_ENV)
        return cls(**json.loads(raw)) if raw else None

    def to_env(self) -> str:
        return json.dumps(self.__dict__)

    @property
    def store(self) -> NodeStore:
        return NodeStore(self.base, self.run_id, self.node)

    def client(self):
        """An etcd client configured as the agent's (endpoints, TLS, auth)."""
        from resilient.rendezvous.registry import etcd_client

        return etcd_client(self.etcd, {"retry_timeout": 10.0, **self.etcd_conf}, self.run_id)

    def secret(self) -> bytes:
        """The job secret's material: from the agent's private copy (hex, mode 0600) or, with no
        agent (a test, a tool), from the environment (:func:`resilient.secret.require_secret`)."""
        if not self.secret_file:
            from resilient.secret import require_secret

            return require_secret(what="a worker's node store").material
        return bytes.fromhex(Path(self.secret_file).read_text().strip())


# ------------------------------------------------------------------ candidates
def memory_plan(info: StoreInfo, limit: int = 4, events: Any = None, copies: Iterable[Copy] = ()) -> list[dict]:
    """Rank 0: memory versions restorable from live holders, newest first (JSON-able).
    Only registry entries and commit records that authenticate with the job secret count, and
    of these only the commits no rollback abandoned (:mod:`.epoch`; the run's epoch is read
    from etcd and from ``copies``, the run's ledger beside it)."""
    return memory_plan_epoch(info, limit, events, copies)[0]


def memory_plan_epoch(info: StoreInfo, limit: int = 4, events: Any = None,
                      copies: Iterable[Copy] = ()) -> tuple[list[dict], Epoch]:
    """:func:`memory_plan`, and the run's epoch (what the restore judges every candidate's
    manifest by: a kept tree's versions have no commit record to judge)."""
    from resilient.secret import REGISTRY, read_records

    secret = info.secret()
    with info.client() as client:
        live = {doc["node"]: doc for doc in read_records(client, f"/resilient/{info.run_id}/nodes/", REGISTRY,
                                                         secret, events, "node registry entry").values()
                if isinstance(doc.get("node"), str)}
        records: dict[int, CommitRecord] = {}
        commits, epoch = read_commits_epoch(client, info.run_id, secret, events, copies)
        for rec in commits:
            have = records.get(rec.step)
            if have is None or have.attempt != rec.attempt:
                if have is None or rec.k >= have.k:
                    records[rec.step] = rec
                continue
            have.add_holders(rec.holders)  # same version, both tiers: union of holders
    plan = []
    # (step, rank) -> nodes whose adopted tree holds that rank's files of it (incarnation aside):
    # a kept tree vouches for the ranks it holds, not for every rank a commit once gave its node
    kept_by: dict[tuple[int, str], set[str]] = {}
    for step, attempt, world, holders in kept_plans(live):
        rec = records.get(step)
        if rec is not None and rec.attempt != attempt:
            continue  # a commit record names another write of that step: it wins
        if rec is None:
            rec = records[step] = CommitRecord(step, attempt, world)
        rec.add_holders(holders)   # committed too: its holders, and the kept trees that hold it now
        for r, h in holders.items():
            kept_by[(step, r)] = set(h)
    for step in sorted(records, reverse=True):
        rec = records[step]
        # A holder counts if it is alive *and* is the same incarnation: an agent started after
        # the commit (a restarted node, same name) has a fresh, empty store, unless it adopted
        # the tree its dead predecessor left (kept_by).
        holders = {r: [n for n in h if n in live and (n in kept_by.get((step, r), ())
                                                      or float(live[n].get("since", 0)) <= rec.time)]
                   for r, h in rec.holders.items()}
        if len(holders) < rec.world or any(not holders.get(str(r)) for r in range(rec.world)):
            continue
        peers = {n: live[n].get("store", "") for h in holders.values() for n in h}
        plan.append({"step": step, "attempt": rec.attempt, "world": rec.world,
                     "holders": holders, "peers": peers})
        if len(plan) >= limit:
            break
    return plan, epoch


def kept_plans(live: dict[str, dict]) -> list[tuple[int, str, int, dict[str, list[str]]]]:
    """Versions that the live nodes' adopted trees hold (their registry entries' ``kept``: trees
    dead agents of this run left on their machines, :mod:`.storeroot`), as ``(step, attempt,
    world, {rank: [nodes]})`` where every rank has a holder. A hint to plan with: the restore
    authenticates every manifest and chunk it reads, and falls back on any that fails."""
    held: dict[tuple[int, str, int], dict[str, list[str]]] = {}
    for node, doc in live.items():
        for k in doc.get("kept") or ():
            try:
                key = (int(k["step"]), str(k["attempt"]), int(k["world"]))
                ranks = [int(r) for r in k["ranks"]]
            except (KeyError, TypeError, ValueError):
                continue
            for r in ranks:
                held.setdefault(key, {}).setdefault(str(r), []).append(node)
    return [(step, attempt, world, holders) for (step, attempt, world), holders in held.items()
            if 0 < world <= 1 << 16 and all(str(r) in holders for r in range(world))]


def forget_after(info: StoreInfo, step: int, copies: Iterable[Copy] = (), always: bool = True,
                 events: Any = None) -> Epoch | None:
    """Rank 0, after restoring ``step``: drop commit records of later steps (a rollback), so
    a version of the abandoned future is never restored later, even if put back: the run's
    epoch goes up first, in etcd and in ``copies`` (:func:`~resilient.snapshot.commits.abandon_commits_after`).
    ``always=False``: only when there are later records (a restore that went back past nothing).
    The new epoch, or None when nothing changed."""
    with info.client() as client:
        return abandon_commits_after(client, info.run_id, info.secret(), step, copies, events, always=always)


def broadcast_json(value: Any) -> Any:
    """Rank 0's JSON value on every rank (as bytes in a tensor: nothing is unpickled)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return value
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, 0)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.cpu().numpy()))


# ------------------------------------------------------------------ reader
class MemoryReader:
    """Reads one memory-committed version from the holders' node stores (duck-types SnapshotReader)."""

    threads = 4

    def __init__(self, plan: dict, info: StoreInfo, secret: bytes, events: Any = None,
                 timeout: timedelta = timedelta(seconds=30)):
        self.plan, self.info, self.secret, self.events, self.timeout = plan, info, secret, events, timeout
        self.auth = VersionAuth(secret)
        self.url = f"memory://{info.run_id}/step-{plan['step']}"
        self.store = info.store
        self._local = threading.local()
        self._clients: list[PeerClient] = []
        self._lock = threading.Lock()
        self._peer_bytes = 0
        self._manifest: Manifest | None = None

    def manifest_path(self, step: int) -> str:
        return f"{self.url}/manifest"

    def served_tier(self) -> str:
        return "peer" if self._peer_bytes else "local"

    def _holders(self, rank: int) -> list[str]:
        hs = self.plan["holders"].get(str(rank), [])
        return sorted(hs, key=lambda n: (n != self.info.node, n))

    def _fetch(self, holder: str, rel: str, offset: int = 0, length: int | None = None,
               into: memoryview | None = None) -> bytes | memoryview:
        if holder == self.info.node:
            return self.store.read(rel, offset, length) if into is None else self.store.read_into(rel, offset, into)
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        c = clients.get(holder)
        if c is None:
            c = clients[holder] = PeerClient(self.plan["peers"][holder], self.secret, self.timeout)
            with self._lock:
                self._clients.append(c)
        try:
            data = c.get(rel, offset, length)
        except PeerError:
            clients.pop(holder, None)
            raise
        with self._lock:
            self._peer_bytes += len(data)
        return data

    def _from_holders(self, rank: int, rel: str, check, offset: int = 0, length: int | None = None,
                      into: memoryview | None = None) -> Any:
        """``check(bytes)`` on the first holder's copy that passes; bad copies are reported and skipped.
        ``into``: where this node's own copy is read to (``check`` is then given ``into``)."""
        last: SnapshotError | None = None
        for holder in self._holders(rank):
            try:
                return check(self._fetch(holder, rel, offset, length, into))
            except (SnapshotError, OSError) as e:
                # every skipped copy is reported: a damaged one (CRC), and a short or
                # missing one, which is as bad for this restore
                last = e if isinstance(e, SnapshotError) else SnapshotIncomplete(str(e), rel)
                report_auth(self.events, last)  # a forged copy: auth_failure, then the next holder
                emit(self.events, "restore_fallback", step=self.plan["step"], url=self.url, error=str(last),
                     error_type=type(last).__name__, obj=f"{holder}:{rel}", holder=holder, copy_skipped=True,
                     tier="local" if holder == self.info.node else "peer")
        raise last or SnapshotIncomplete(f"{self.url}: no live holder of rank {rank}", rel)

    def manifest(self, step: int) -> Manifest:
        if self._manifest is None:
            vdir, att = version_dir(step), self.plan["attempt"]
            parts = []
            for r in range(self.plan["world"]):
                rel = f"{vdir}/{att}/r{r:05d}.json"
                parts.append(self._from_holders(r, rel, lambda b, rel=rel, r=r: self._rank_manifest(b, rel, r)))
            self._manifest = merge_rank_manifests(parts, self.url)
        return self._manifest

    def _rank_manifest(self, data: bytes, rel: str, rank: int) -> Manifest:
        """A holder's copy of a rank manifest, authenticated, and the one the commit named: a
        genuine manifest of another rank or attempt put in its place is refused too."""
        m = manifest_from_json(self.auth.open_manifest(data, f"{self.url}/{rel}"), rel)
        if (m.rank, m.attempt, m.step) != (rank, self.plan["attempt"], self.plan["step"]):
            raise SnapshotCorrupt(f"{self.url}/{rel}: holds rank {m.rank} of {m.attempt} step {m.step}, not rank "
                                  f"{rank} of {self.plan['attempt']} step {self.plan['step']}", rel)
        return m

    def read_chunk(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord) -> torch.Tensor:
        rel = f"{version_dir(manifest.step)}/{chunk.object}"
        where = f"{self.url}/{chunk.object}@{chunk.offset}+{chunk.length} ({tensor.name})"

        def check(data: bytes) -> torch.Tensor:
            return decode_chunk(open_chunk(self.auth, manifest.step, chunk, data, where), tensor, chunk, where)

        return self._from_holders(rank_of(rel), rel, check, chunk.offset, chunk.length)

    def read_into(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord, out: torch.Tensor) -> bool:
        """Read an uncompressed chunk straight into ``out`` (a contiguous CPU tensor of the
        chunk's shape and dtype) and verify it there: from this node's store one copy and
        no bytes object (:meth:`read_chunk` makes two, plus the copy out of its result); a
        peer's copy is verified, then copied in. False when this does not apply (the caller uses :meth:`read_chunk`).
        A bad copy is reported and the next holder's read over it; if none is good this
        raises and ``out`` holds garbage (the restore then fails or falls back as a whole)."""
        view = chunk_view(chunk, out)
        if view is None:
            return False
        rel = f"{version_dir(manifest.step)}/{chunk.object}"
        where = f"{self.url}/{chunk.object}@{chunk.offset}+{chunk.length} ({tensor.name})"

        def check(data: bytes | memoryview) -> bool:
            open_chunk(self.auth, manifest.step, chunk, data, where)
            if data is not view:      # a peer's copy
                view[:] = data
            return True

        return self._from_holders(rank_of(rel), rel, check, chunk.offset, chunk.length, into=view)

    def close(self) -> None:
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()


def tiered_candidates(info: StoreInfo | None, durable: SnapshotReader | None, events: Any,
                      secret: bytes | None, copies: Iterable[Copy] = ()
                      ) -> tuple[list[tuple[int, Any, str]], list[MemoryReader], Epoch | None]:
    """The same ``(step, reader, tier)`` list on every rank: memory versions and durable ones,
    newest step first, memory before durable at one step; and, on rank 0, the run's rollback
    epoch (None elsewhere, and without a node store: no ledger to read it from), by which
    :func:`~.restore.restore_candidates` refuses an abandoned version of any tier. Collective."""
    doc, epoch = None, None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        mem = []
        if info is not None:
            try:
                mem, epoch = memory_plan_epoch(info, events=events, copies=copies)
            except Exception as e:  # etcd down: the durable tier still works
                emit(events, "restore_fallback", step=-1, url=f"memory://{info.run_id}", tier="memory",
                     error=f"cannot read memory commit records: {e}", error_type=type(e).__name__, obj=None)
                try:   # the ledger's other copies still say it
                    epoch = run_epoch(None, secret, info.run_id, copies, events) if secret is not None else None
                except Exception:
                    epoch = None
        steps = []
        if durable is not None:
            try:
                steps = durable.complete_steps()
            except SnapshotError as e:
                emit(events, "restore_fallback", step=-1, url=durable.url, tier="durable", error=str(e),
                     error_type=type(e).__name__, obj=e.obj)
        doc = {"memory": mem, "durable": steps}
    doc = broadcast_json(doc)
    readers = [MemoryReader(p, info, secret, events) for p in doc["memory"]] if info is not None else []
    out = [(r.plan["step"], r, "memory") for r in readers]
    out += [(s, durable, "durable") for s in doc["durable"]]
    out.sort(key=lambda c: (-c[0], c[2] != "memory"))
    return out, readers, epoch
