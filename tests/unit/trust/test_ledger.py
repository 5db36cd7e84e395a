"""The ledger's generations (resilient/ledger.py) and the run's epoch (resilient/snapshot/epoch.py):
whatever a writer of etcd puts back, deletes or forges, in whatever order with the genuine
writes, a reader ends at the newest genuine state; a commit record a rollback abandoned is never
admitted again, and every other one is. Real etcd, real files."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.agent.quarantine import Quarantine
from resilient_chaos.etcd_testing import unique_run_id
from resilient.ledger import DirCopy, EtcdCopy, gen_of, newest, run_copies
from resilient.secret import QUARANTINE, JobSecret
from resilient.snapshot.epoch import MAX_FLOORS, Epoch

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180)]

SECRET = JobSecret(b"l" * 48)


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


# ------------------------------------------------------------------ generations, pure
def test_the_highest_generation_wins_and_a_tie_goes_to_the_order():
    docs = [{"gen": 1, "s": "a"}, {"gen": 3, "s": "old"}, {"gen": 3, "s": "new"}, {"s": "pre-gen"}]
    assert newest(docs, lambda d: d["s"] == "new")["s"] == "new"
    assert newest([]) is None
    assert [gen_of(d) for d in ({"gen": -1}, {"gen": True}, {"gen": "2"}, {})] == [0, 0, 0, 0]


# ------------------------------------------------------------------ generations against an etcd writer
WRITERS = {
    # who writes, reaching which copies: the agent (etcd, its run dir, the durable tier), the CLI
    # on another machine (etcd, durable), the CLI on the node's machine after its embedded etcd
    # went with its job (run dir, durable)
    "agent": ("etcd", "run_dir", "durable"),
    "cli_remote": ("etcd", "durable"),
    "cli_local": ("run_dir", "durable"),
}
legit = st.tuples(st.sampled_from(["quarantine", "clear"]), st.sampled_from(sorted(WRITERS)))
attack = st.tuples(st.sampled_from(["replay", "delete", "forge"]), st.integers(0, 50))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(legit, attack), min_size=1, max_size=12))
def test_any_interleaving_of_writes_clears_and_replays_ends_at_the_newest_genuine_state(client, tmp_path, ops):
    """The attacker writes etcd at will (puts back any genuine record it saw, deletes, forges);
    it cannot write the run dir or the durable tier. A reader of every copy, and a reader of etcd
    and the run dir when every write reaches the run dir, always see the last genuine write."""
    run_id = unique_run_id()
    base = tmp_path / run_id
    places = {"etcd": EtcdCopy(client), "run_dir": DirCopy(base / "run" / "ledger"),
              "durable": DirCopy(base / "durable" / "ledger")}
    key = f"/resilient/{run_id}/quarantine/n"
    seen: list[bytes] = []          # every genuine value etcd held: what the attacker saved
    truth = None
    all_reach_run_dir = True
    for op, arg in ops:
        if op in ("quarantine", "clear"):
            book = Quarantine(None, run_id, SECRET, copies=[places[p] for p in WRITERS[arg]])
            if op == "quarantine":
                book.add("n", reason="sdc", device="n:0")
                truth = "quarantined"
            elif book.clear("n"):
                truth = "cleared"
            all_reach_run_dir &= "run_dir" in WRITERS[arg]
            kv = client.get(key)
            if kv is not None:
                seen.append(kv.value)
        elif op == "replay" and seen:
            client.put(key, seen[arg % len(seen)])
        elif op == "delete":
            client.delete(key)
        elif op == "forge":
            client.put(key, json.dumps({"node": "n", "state": "cleared", "gen": 10 ** 6, "mac": "0" * 64}))
        everyone = Quarantine(client, run_id, SECRET, copies=[places["run_dir"], places["durable"]]).get("n")
        assert (everyone is not None) == (truth == "quarantined"), (op, arg)
        if all_reach_run_dir:
            here = Quarantine(client, run_id, SECRET, copies=[places["run_dir"]]).get("n")
            assert (here is not None) == (truth == "quarantined"), (op, arg)


def test_a_clear_on_etcd_alone_can_be_rolled_back_and_says_so(client, tmp_path):
    """The limit the docstring states: with etcd the only copy, an etcd writer who saved the
    quarantine puts it back over the clear and the node is refused again."""
    run_id = unique_run_id()
    q = Quarantine(client, run_id, SECRET)
    q.add("n", reason="sdc")
    saved = client.get(q.prefix + "n").value
    assert q.clear("n") and q.get("n") is None and q.where == ["etcd"]
    client.put(q.prefix + "n", saved)
    assert q.get("n") is not None
    # with the run dir's copy the same replay changes nothing
    run_dir = tmp_path / "run"
    q = Quarantine(client, run_id, SECRET, copies=run_copies(run_dir))
    assert q.clear("n")
    client.put(q.prefix + "n", saved)
    assert q.get("n") is None and q.all() == {}


def test_the_run_dirs_copy_is_private_and_refuses_a_path_out_of_it(tmp_path):
    old = os.umask(0)
    try:
        copy = DirCopy(tmp_path / "run" / "ledger")
        copy.put("/resilient/r1/quarantine/n", SECRET.seal_record(QUARANTINE, "/resilient/r1/quarantine/n", {}))
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path / "run").as_posix(): p.stat().st_mode & 0o777
             for p in (tmp_path / "run").rglob("*")}
    assert modes == {"ledger": 0o700, "ledger/r1": 0o700, "ledger/r1/quarantine": 0o700,
                     "ledger/r1/quarantine/n": 0o600}
    for bad in ("/resilient/../x", "/resilient/r1/../../x", "/other/r1/n", "/resilient/r1/.."):
        with pytest.raises(ValueError):
            copy.get(bad)


# ------------------------------------------------------------------ the epoch, pure
commits_and_rollbacks = st.lists(st.one_of(st.tuples(st.just("commit"), st.integers(0, 40)),
                                           st.tuples(st.just("rollback"), st.integers(0, 40))), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=commits_and_rollbacks)
def test_a_commit_is_admitted_exactly_when_no_later_rollback_abandoned_it(ops):
    """Model: a rollback to step f deletes every commit record of a later step; commits made
    afterwards are new records. Every record ever made, put back at any time, is admitted by the
    final epoch exactly when the model still holds it."""
    epoch = Epoch()
    made: list[tuple[int, int]] = []   # (step, epoch made in), every record ever written
    live: set[tuple[int, int]] = set()
    for op, step in ops:
        if op == "commit":
            made.append((step, epoch.gen))
            live.add((step, epoch.gen))
        else:
            epoch = Epoch.from_doc(epoch.rolled_back(step).to_doc())   # through its record, as stored
            live = {(s, e) for s, e in live if s <= step}
    for step, gen in made:
        assert epoch.admits(step, gen) == ((step, gen) in live), (step, gen, epoch)


def test_past_the_floors_it_keeps_the_epoch_refuses_what_it_no_longer_knows():
    epoch = Epoch()
    for i in range(MAX_FLOORS + 5):
        epoch = epoch.rolled_back(1000 + i)
    assert len(epoch.floors) == MAX_FLOORS and epoch.since == 5
    assert not epoch.admits(0, 2)          # made before the floors it keeps: refused, even a low step
    assert epoch.admits(1004 + 1, 5)       # within what it keeps: the rollbacks after epoch 5 kept >= 1005
    assert not epoch.admits(1006, 5)
    assert Epoch.from_doc({"gen": "x"}).admits(0, 0) is False   # a malformed record: the safe side
