"""The memory tiers commit only versions a restore can use (real etcd, real node stores
and peer servers, the replicator's own loop).

Before this check, a layout bug that wrote a box twice (the (pp=2, dp=2, tp=2) GPT's
replicas, fixed in boxes.py) had every version committed to node RAM and every
restore refuse it (``SnapshotCorrupt ... overlap``): the job stopped at its first
worker loss. Now the replicator checks what the restore checks
(``merge_rank_manifests``) and a version whose ranks overlap is reported
(``upload_error``, phase ``commit``) and left uncommitted, while healthy versions
before and after it commit."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from resilient_chaos.etcd_testing import unique_run_id
from resilient.events import EventLog, read_events
from resilient.secret import JobSecret
from resilient.snapshot.auth import VersionAuth
from resilient.snapshot.api import ChunkRecord, Manifest, SnapshotCorrupt, TensorRecord
from resilient.snapshot.format import checksum, crc, manifest_to_json, version_dir
from resilient.snapshot.commits import LOCAL, RECORD_TIERS, REPLICATED
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions, commit_key
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.peer import PeerServer
from resilient.snapshot.tiers import MemoryReader, StoreInfo

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

SECRET = JobSecret(b"u" * 48)
AUTH = VersionAuth(SECRET)  # the workers sign what they write: the replicator spreads nothing else
ATTEMPT = "t0-000001"
WORLD = 2
ROWS = 4
HEALTHY, OVERLAPPING, HEALTHY_AGAIN = 1, 2, 3


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


def _put(store: NodeStore, rel: str, data: bytes) -> None:
    w = store.writer(rel)
    w.write(data)
    w.commit(len(data), crc(data))


def write_rank(store: NodeStore, step: int, rank: int, overlap: bool) -> None:
    """Rank ``rank``'s part and manifest of the (ROWS, 3) tensor ``w``: its own half of the
    rows, or (``overlap``, the replica bug) all of them, as its replica writes them too."""
    first, rows = (0, ROWS) if overlap else (rank * ROWS // WORLD, ROWS // WORLD)
    data = torch.arange(first * 3, (first + rows) * 3, dtype=torch.float32).numpy().tobytes()
    obj = f"{ATTEMPT}/r{rank:05d}-p0000.bin"
    _put(store, f"{version_dir(step)}/{obj}", data)
    chunk = ChunkRecord(obj, 0, len(data), len(data), (first, 0), (rows, 3), checksum(data),
                        mac=AUTH.chunk_mac(step, ATTEMPT, data))
    m = Manifest(step=step, world=WORLD, layout={"dp": WORLD}, config_digest="test", attempt=ATTEMPT,
                 tensors={"w": TensorRecord("w", (ROWS, 3), "float32", [chunk])}, rank_extras={rank: None},
                 created=time.time(), rank=rank)
    _put(store, f"{version_dir(step)}/{ATTEMPT}/r{rank:05d}.json", AUTH.sign_manifest(manifest_to_json(m)))


def commit_errors(log: EventLog) -> list[dict]:
    return [e for e in read_events(log.path) if e["event"] == "upload_error" and e["phase"] == "commit"]


def run_versions(stores: dict[str, NodeStore], ranks: dict[str, set[int]], reps: dict[str, Replicator]) -> None:
    """Each version in turn (the replicator takes the newest one ready): written, then handled."""
    for rep in reps.values():
        rep.set_workers(ranks[rep.node], WORLD)
    for step in (HEALTHY, OVERLAPPING, HEALTHY_AGAIN):
        for node, store in stores.items():
            for r in ranks[node]:
                write_rank(store, step, r, overlap=step == OVERLAPPING)
        for rep in reps.values():
            assert rep.flush(timedelta(seconds=20)), f"step {step} was not handled"


def test_a_version_whose_ranks_overlap_is_not_committed(client, tmp_path):
    """One node, both ranks: step 2's ranks claim the same rows; steps 1 and 3 tile ``w``."""
    run_id = unique_run_id()
    store = NodeStore(tmp_path / "shm", run_id, "a")
    store.create()
    log = EventLog(tmp_path / "events.jsonl", node="a")
    rep = Replicator(store, client, run_id, "a", SECRET, lambda: {}, ReplicatorOptions(), log)
    try:
        run_versions({"a": store}, {"a": {0, 1}}, {"a": rep})
        assert client.get(commit_key(run_id, LOCAL, HEALTHY)) is not None
        assert client.get(commit_key(run_id, LOCAL, OVERLAPPING)) is None
        assert client.get(commit_key(run_id, REPLICATED, OVERLAPPING)) is None
        assert client.get(commit_key(run_id, LOCAL, HEALTHY_AGAIN)) is not None
        (err,) = commit_errors(log)
        assert err["step"] == OVERLAPPING and err["tier"] == "local"
        assert "overlap" in err["error"] and "'w'" in err["error"]
        # the check agrees with a restore's: the refused version is one MemoryReader refuses,
        # the committed ones it reads
        (tmp_path / "secret").write_text(SECRET.material.hex())
        info = StoreInfo(base=str(tmp_path / "shm"), run_id=run_id, node="a", etcd="", secret_file=str(tmp_path / "secret"))
        for step in (OVERLAPPING, HEALTHY_AGAIN):  # the store keeps the newest two (and the commits)
            plan = {"step": step, "attempt": ATTEMPT, "world": WORLD, "holders": {"0": ["a"], "1": ["a"]}, "peers": {}}
            reader = MemoryReader(plan, info, SECRET.material)
            if step == OVERLAPPING:
                with pytest.raises(SnapshotCorrupt, match="overlap"):
                    reader.manifest(step)
            else:
                assert [c.offsets for c in reader.manifest(step).tensors["w"].chunks] == [(0, 0), (2, 0)]
    finally:
        rep.close()
        log.close()
        store.remove()


@pytest.mark.parametrize("k", [0, 1])
def test_ranks_on_two_nodes_that_overlap_are_not_committed(client, tmp_path, k):
    """Rank 0 on node a, rank 1 on node b: the committer checks the other node's rank too,
    parsed from its own store after the other's push (k=1) or read from it (k=0)."""
    run_id = unique_run_id()
    stores = {n: NodeStore(tmp_path / n, run_id, n) for n in ("a", "b")}
    servers, reps, logs = {}, {}, {}
    try:
        for n, store in stores.items():
            store.create()
            servers[n] = PeerServer(store, SECRET, host="127.0.0.1")
        registry = {n: {"store": srv.address, "domain": n} for n, srv in servers.items()}
        for n, store in stores.items():
            logs[n] = EventLog(tmp_path / f"events-{n}.jsonl", node=n)
            reps[n] = Replicator(store, client, run_id, n, SECRET, lambda: registry, ReplicatorOptions(k=k), logs[n])
        run_versions(stores, {"a": {0}, "b": {1}}, reps)
        for tier in RECORD_TIERS:
            assert client.get(commit_key(run_id, tier, HEALTHY)) is not None
            assert client.get(commit_key(run_id, tier, OVERLAPPING)) is None
            assert client.get(commit_key(run_id, tier, HEALTHY_AGAIN)) is not None
        errors = [e for log in logs.values() for e in commit_errors(log)]
        assert [e["step"] for e in errors] == [OVERLAPPING]  # reported once, by the node that would commit it
        assert "overlap" in errors[0]["error"] and errors[0]["tier"] == ("peer" if k else "local")
    finally:
        for rep in reps.values():
            rep.close()
        for srv in servers.values():
            srv.close()
        for log in logs.values():
            log.close()
        for store in stores.values():
            store.remove()


def test_what_the_snapshotter_writes_commits(client, tmp_path):
    """The check reads the real writer's manifests as a restore does: a 0-d tensor, an empty
    one, several chunks of one tensor, bf16 and int64, plain values. Each version commits."""
    from resilient.snapshot import Snapshotter

    run_id = unique_run_id()
    store = NodeStore(tmp_path / "shm", run_id, "a")
    store.create()
    log = EventLog(tmp_path / "events.jsonl", node="a")
    rep = Replicator(store, client, run_id, "a", SECRET, lambda: {}, ReplicatorOptions(), log)
    try:
        rep.set_workers({0}, 1)
        state = {"w": torch.randn(300, 7), "scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4),
                 "half": torch.randn(40, dtype=torch.bfloat16), "ids": torch.arange(9), "lr": 0.1}
        with Snapshotter(store.url, commit=False, secret=SECRET, compress="none", chunk_bytes=4000, part_bytes=30000) as snap:
            for step in (1, 2):
                snap.save(step, state)
                assert snap.wait()
                assert rep.flush(timedelta(seconds=20))
                assert client.get(commit_key(run_id, LOCAL, step)) is not None, commit_errors(log)
        assert commit_errors(log) == []
    finally:
        rep.close()
        log.close()
        store.remove()
