"""The memory tiers' commit led by one node (resilient.snapshot.memcommit, protocol
"leader"): every node reports its holds to the node holding rank 0 over the authenticated
peer channel, and that leader writes one commit transaction per version, whatever the node
count. Real etcd, real node stores, real peer servers, the replicators' own loops."""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from resilient_chaos.etcd_testing import unique_run_id
from resilient.events import EventLog, read_events
from resilient.secret import COMMIT, HOLDS, JobSecret
from resilient.snapshot.commits import REPLICATED
from resilient.snapshot.memcommit import Replicator, ReplicatorOptions, commit_key, leader_key
from resilient.snapshot.nodestore import Doorbell, NodeStore
from resilient.snapshot.peer import PIECE, PeerServer

from launchutil import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from scale_node import write_rank  # noqa: E402  (the simulator's tiny rank: one row of a (world, 4) tensor)

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]

SECRET = JobSecret(b"L" * 48)
GATHER = timedelta(seconds=1.5)


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


class Fleet:
    """``names`` nodes, each a store, a peer server and a replicator serving its holds;
    ``rates``: a node's push rate cap (bytes/s), which makes its replicator that much slower."""

    def __init__(self, client, tmp_path: Path, names: list[str], rates: dict[str, float] | None = None,
                 gather: timedelta = GATHER):
        self.client, self.run_id = client, unique_run_id()
        self.stores, self.servers, self.reps, self.logs = {}, {}, {}, {}
        self.registry: dict[str, dict] = {}
        for n in names:
            self.stores[n] = NodeStore(tmp_path / "shm", self.run_id, n)
            self.stores[n].create()
            self.servers[n] = PeerServer(self.stores[n], SECRET, host="127.0.0.1")
            self.registry[n] = {"store": self.servers[n].address, "domain": n}
        for n in names:
            self.logs[n] = EventLog(tmp_path / f"events-{n}.jsonl", node=n)
            self.reps[n] = Replicator(self.stores[n], client, self.run_id, n, SECRET, lambda: dict(self.registry),
                                      ReplicatorOptions(k=1, gather_timeout=gather, protocol="leader",
                                                        rate=(rates or {}).get(n, 0.0)), self.logs[n])
            self.reps[n].serve(self.servers[n])

    def workers(self, ranks: dict[str, set[int]], world: int) -> None:
        for n, r in ranks.items():
            self.reps[n].set_workers(r, world)

    def land(self, step: int, attempt: str, ranks: dict[str, set[int]], world: int) -> None:
        """Each node of ``ranks`` writes its ranks of ``step`` and rings its doorbell, as workers do."""
        for n, rs in ranks.items():
            for r in rs:
                write_rank(self.stores[n], step, attempt, r, world, SECRET)
            Doorbell.ring(self.reps[n]._bell.path)

    def version(self, step: int, attempt: str, ranks: dict[str, set[int]], world: int) -> None:
        """:meth:`land`, then each node is waited for until it handled the version."""
        self.land(step, attempt, ranks, world)
        for n in ranks:
            assert self.reps[n].flush(timedelta(seconds=30)), f"{n} did not handle step {step}"

    def kill(self, n: str) -> None:
        """As a dead agent: its port refuses, its replicator stops."""
        self.servers.pop(n).close()
        self.reps.pop(n).close()
        self.registry.pop(n)

    def errors(self, n: str) -> list[dict]:
        return [e for e in read_events(self.logs[n].path) if e["event"] == "upload_error" and e["phase"] == "commit"]

    def commit(self, step: int) -> bool:
        return self.client.get(commit_key(self.run_id, REPLICATED, step)) is not None

    def commits(self, n: str) -> list[int]:
        """The steps node ``n`` committed at the peer tier so far (its events: the replicator
        deletes old commit records from etcd)."""
        return [e["step"] for e in read_events(self.logs[n].path) if e["event"] == "commit" and e["tier"] == "peer"]

    def close(self) -> None:
        for rep in self.reps.values():
            rep.close()
        for srv in self.servers.values():
            srv.close()
        for log in self.logs.values():
            log.close()
        for store in self.stores.values():
            store.remove()


@pytest.fixture
def fleet(client, tmp_path):
    made: list[Fleet] = []
    yield lambda names, **kw: made.append(Fleet(client, tmp_path, names, **kw)) or made[-1]
    for f in made:
        f.close()


def test_one_commit_txn_per_version_and_no_holds_in_etcd(fleet, client):
    f = fleet(["a", "b", "c"])
    ranks = {"a": {0}, "b": {1}, "c": {2}}
    f.workers(ranks, 3)
    f.version(1, "t0-000001", ranks, 3)  # the first one also announces the leader
    assert f.commit(1)
    before = client.revision()
    for step in (2, 3, 4):
        f.version(step, "t0-000001", ranks, 3)
        assert f.commit(step)
    # etcd's revision moves once per write txn: one per version, at any node count
    assert client.revision() - before == 3
    assert client.get_prefix(f"/resilient/{f.run_id}/mem/holds/") == []
    rec = SECRET.open_record(HOLDS, leader_key(f.run_id, "t0-000001"),
                             client.get(leader_key(f.run_id, "t0-000001")).value)
    assert rec["node"] == "a"
    # the others learned the commits from the leader's replies (one version behind)
    assert f.reps["b"].committed[REPLICATED] >= 3 and f.reps["c"].committed[REPLICATED] >= 3


def test_a_node_that_never_reports_leaves_the_version_uncommitted(fleet):
    f = fleet(["a", "b", "c"])
    ranks = {"a": {0}, "b": {1}, "c": {2}}
    f.workers(ranks, 3)
    f.version(1, "t0-000001", {"a": {0}, "b": {1}}, 3)  # c's rank never lands: c never reports
    assert not f.commit(1)
    (err,) = f.errors("a")
    assert err["step"] == 1 and "[2]" in err["error"] and "not reported" in err["error"]
    f.version(2, "t0-000001", ranks, 3)  # all report again: the run commits again
    assert f.commit(2)


def test_leader_lost_mid_commit_then_the_next_group_commits(fleet):
    f = fleet(["a", "b", "c"])
    ranks = {"a": {0}, "b": {1}, "c": {2}}
    f.workers(ranks, 3)
    f.version(1, "t0-000001", ranks, 3)
    assert f.commit(1)
    # step 2: b and c report, a gathers (c's report is what it still waits for)... and dies
    for n in ("a", "b"):
        write_rank(f.stores[n], 2, "t0-000001", min(ranks[n]), 3, SECRET)
        Doorbell.ring(f.reps[n]._bell.path)
    assert f.reps["b"].flush(timedelta(seconds=30))
    f.kill("a")
    write_rank(f.stores["c"], 2, "t0-000001", 2, 3, SECRET)
    Doorbell.ring(f.reps["c"]._bell.path)
    assert f.reps["c"].flush(timedelta(seconds=30))
    assert not f.commit(2)
    assert any("refuse" in e["error"].lower() or "failed" in e["error"] for e in f.errors("c"))
    # the re-formed group: b holds rank 0 now and leads the new attempt
    new = {"b": {0}, "c": {1}}
    f.workers(new, 2)
    f.version(3, "t1-000002", new, 2)
    assert f.commit(3) and not f.commit(2)


def test_a_new_worker_group_ends_the_leaders_wait_for_the_old_groups_holds(fleet):
    """A node's worker dies before writing step 2: the leader waits for holds that never
    come. The agents start a new worker group; the leader must drop the old group's version
    at once and commit the new group's first one, not wait out its gather timeout (60 s
    here, more than the flush below allows) while the new group trains uncommitted."""
    f = fleet(["a", "b", "c"], gather=timedelta(seconds=60))
    ranks = {"a": {0}, "b": {1}, "c": {2}}
    f.workers(ranks, 3)
    f.version(1, "t0-000001", ranks, 3)
    assert f.commit(1)
    f.land(2, "t0-000001", {"a": {0}, "b": {1}}, 3)   # c's rank 2 never lands
    deadline = time.monotonic() + 30
    while not any(k[0] == 2 for k in f.reps["a"].protocol._reports) and time.monotonic() < deadline:
        time.sleep(0.05)   # a is gathering step 2
    assert any(k[0] == 2 for k in f.reps["a"].protocol._reports)
    # The new group starts at once, within the replicator's 0.5 s slack of times
    # (Replicator.since): step 2 is ruled out by its attempt group, not taken up again.
    f.workers(ranks, 3)                                 # the new worker group
    f.version(3, "t1-000002", ranks, 3)
    assert f.commit(3) and not f.commit(2)
    assert not f.errors("a")   # dropped with its group, not timed out


def test_two_leaders_racing_for_one_attempt_one_leads_one_commit(fleet, client):
    """Two nodes both hold rank 0 (an old group's and a new one's): their claims race, one
    leads, the other reports to it; each version is committed exactly once."""
    f = fleet(["a", "b", "c"])
    ranks = {"a": {0}, "b": {0}, "c": {1}}
    f.workers(ranks, 2)
    won: dict[str, bool] = {}
    go = threading.Barrier(2)

    def claim(n: str) -> None:
        go.wait()
        won[n] = f.reps[n].protocol._leads("t0-000001")

    threads = [threading.Thread(target=claim, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won.values()) == [False, True]
    leader = next(n for n, w in won.items() if w)
    f.version(1, "t0-000001", ranks, 2)
    assert f.commit(1)
    rec = SECRET.open_record(COMMIT, commit_key(f.run_id, REPLICATED, 1),
                             client.get(commit_key(f.run_id, REPLICATED, 1)).value)
    # The leader commits once every rank is held: rank 0 by itself (and its replica), with or
    # without the other rank-0 holder's report, which may come after.
    assert leader in rec["holders"]["0"] and rec["holders"]["1"][0] == "c"
    assert not f.errors(leader) and not f.errors("c")


def test_nodes_handling_versions_at_their_own_pace_under_load_still_commit(fleet):
    """Versions land faster than any node handles them, and each node handles them at its own
    pace (b's and c's pushes are rate-capped: ~0.2 s and ~0.35 s a version, a's are not). Each
    node's replicator skips to the newest version when it is behind, so on its own each would
    pick a different version; the followers must handle the version the leader gathers, or
    the leader never sees every rank of any version and commits none (CI: the local tier
    stuck for 90 s while training went on)."""
    per_put = {"b": 0.1, "c": 0.175}  # seconds a put sleeps under the rate cap (a push: 2 puts)
    f = fleet(["a", "b", "c"], rates={n: PIECE / s for n, s in per_put.items()})
    ranks = {"a": {0}, "b": {1}, "c": {2}}
    f.workers(ranks, 3)
    f.version(1, "t0-000001", ranks, 3)  # the leader announced, one commit: the load starts from there
    assert f.commits("a") == [1]
    # A version every 25 ms at every node until three more are committed, for at most 60 s (a
    # loaded host runs the nodes' threads late). Each leader turn waits for the slowest node
    # (~0.35 s) or gives the version up after GATHER (1.5 s); without following the leader nearly
    # every turn is given up, and none is committed. The time alone bounds it: a cap of 400
    # versions (10 s when the host keeps up) ended the load after one commit with the suite beside
    # two busy loops, where each version took ~40 ms to land.
    step, end = 1, time.monotonic() + 60
    while len(f.commits("a")[1:]) < 3 and time.monotonic() < end:
        step += 1
        f.land(step, "t0-000001", ranks, 3)
        time.sleep(0.025)
    under_load = f.commits("a")[1:]
    assert len(under_load) >= 3, f"steps committed while {step - 1} versions landed in 60 s: {under_load}"
    f.version(step + 1, "t0-000001", ranks, 3)  # the load ends: the newest version is committed
    assert f.commit(step + 1)
    assert not f.errors("b") and not f.errors("c")


def test_a_leader_leads_its_worker_groups_versions_under_one_record():
    """A version's attempt directory is ``<group>-<seq>``: keyed by it, every version had a
    leader record of its own, and a follower whose newest version the leader skipped waited
    for a record that never came (the local tier stalled in a two-node job)."""
    from resilient.snapshot.leadcommit import group_of, leader_key

    assert group_of("fdcfbd36970d-000015") == group_of("fdcfbd36970d-000021") == "fdcfbd36970d"
    assert leader_key("run", "fdcfbd36970d-000015") == leader_key("run", "fdcfbd36970d-000021")
    assert group_of("g0") == "g0" and group_of("a-b-000003") == "a-b"   # no seq: the name itself
    assert group_of("g-12") == "g-12"   # not a sequence number


def test_the_agents_take_the_commit_protocol_from_the_snapshot_config():
    from resilient.errors import ConfigError
    from resilient.launch import store_settings
    from resilient.snapshot.config import SnapshotConfig

    assert store_settings(SnapshotConfig()).commit == "leader"
    assert store_settings(SnapshotConfig(commit="etcd")).commit == "etcd"
    with pytest.raises(ConfigError, match="'snapshot.commit' = 'ledaer': use 'etcd' or 'leader'"):
        SnapshotConfig(commit="ledaer")
