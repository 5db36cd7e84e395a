"""The agents' node-loss check at fleet scale (NodeRegistry.lost with neighbours): each
node reads its ring neighbours' entries, and everyone's only every few checks, against a
real etcd; what it reads is authenticated."""

from __future__ import annotations

from datetime import timedelta

import pytest

from resilient.agent.membership import NodeRegistry, RegistryReader, full_check_due
from resilient_chaos.etcd_testing import unique_run_id

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def full_next(reg: NodeRegistry, members: set[str]) -> None:
    """Move ``reg``'s check counter to just before its next full check."""
    while True:
        reg._checks += 1
        if reg.full_due(len(members)):
            reg._checks -= 1
            return


def test_full_checks_come_every_period_at_each_nodes_own_phase():
    names = [f"node-{i}" for i in range(200)]
    period = max(NodeRegistry.full_every, len(names) // 8)   # 25 checks
    full = {n: [c for c in range(1, 3 * period + 1) if full_check_due(n, c, len(names), NodeRegistry.full_every)]
            for n in names}
    assert all(len(c) == 3 and c[1] - c[0] == c[2] - c[1] == period for c in full.values())
    # spread over the period, not all at once: no check sees more than a few nodes' full reads
    per_check = [sum(1 for c in full.values() if check in c) for check in range(1, period + 1)]
    assert max(per_check) <= 4 * len(names) / period, per_check


def test_a_node_watches_its_ring_neighbours_and_everyone_now_and_then(etcd, job_secret):
    run_id = unique_run_id("ring")
    names = [f"n{i}" for i in range(6)]
    with etcd.client() as client:
        regs = {n: NodeRegistry(client, run_id, n, n, timedelta(seconds=30)) for n in names}
        try:
            for r in regs.values():
                r.claim()
            me, others = regs["n0"], set(names) - {"n0"}
            counted = []
            client.on_request = lambda path, seconds: counted.append(path)
            full_next(me, others)
            assert me.lost(others, neighbours=2) == set()  # a full check reads everyone
            assert counted == ["/kv/txn"]  # the count and the entries changed since: all, the first time
            assert me.lost(others, neighbours=2) == set()
            assert counted[1:] == ["/kv/txn"]  # then one read of three keys (n1, n2 and its own)
            regs["n1"].leave()  # a neighbour: seen on the second miss in a row
            regs["n4"].leave()  # not a neighbour: seen on the full checks
            assert me.lost(others, neighbours=2) == set()
            assert me.lost(others, neighbours=2) == {"n1"}
            full_next(me, others)
            assert me.lost(others, neighbours=2) == {"n1"}    # n4's first miss
            full_next(me, others)
            assert me.lost(others, neighbours=2) == {"n1", "n4"}
            # A forged entry under a neighbour's key is no sign of life.
            client.put(me.prefix + "n1", '{"node": "n1", "mac": "00"}')
            assert "n1" in me.lost(others, neighbours=2)
        finally:
            client.on_request = None
            for r in regs.values():
                r.leave()


def test_the_replicators_registry_reader_reads_again_only_after_a_change(etcd, job_secret):
    run_id = unique_run_id("regread")
    with etcd.client() as client:
        regs = [NodeRegistry(client, run_id, f"n{i}", "d", timedelta(seconds=30)) for i in range(3)]
        try:
            for r in regs:
                r.claim()
            read, paths = RegistryReader(client, run_id, job_secret), []
            client.on_request = lambda path, seconds: paths.append(path)
            assert sorted(read()) == ["n0", "n1", "n2"] and paths == ["/kv/txn"]
            paths.clear()
            assert sorted(read()) == ["n0", "n1", "n2"] and paths == ["/kv/txn"]  # unchanged: one small read
            # A change: only the changed entry comes back (and is checked), in the same one request.
            regs[1].update(metrics="127.0.0.1:1")
            count, changed, _ = client.prefix_since(regs[0].prefix, read._revision)
            assert count == 3 and [kv.key.decode() for kv in changed] == [regs[0].prefix + "n1"]
            paths.clear()
            assert read()["n1"]["metrics"] == "127.0.0.1:1" and paths == ["/kv/txn"]
            # A removal: the bare keys tell which.
            regs[2].leave()
            paths.clear()
            assert sorted(read()) == ["n0", "n1"] and paths == ["/kv/txn", "/kv/range"]
            # A forged overwrite drops the entry; a new node's entry is added.
            client.put(regs[0].prefix + "n0", '{"node": "n0", "mac": "00"}')
            extra = NodeRegistry(client, run_id, "n5", "d", timedelta(seconds=30))
            extra.claim()
            regs.append(extra)
            assert sorted(read()) == ["n1", "n5"]
            # A key whose value it never saw, unchanged since (an etcd restored from an older
            # snapshot whose revisions caught up between two reads): it reads afresh.
            del read._nodes["n5"]
            assert sorted(read()) == ["n1", "n5"]
        finally:
            client.on_request = None
            for r in regs:
                r.leave()


def test_a_lapsed_lease_is_a_loss_only_with_a_second_signal(etcd, job_secret):
    """A node whose key is gone but whose agent lives (a stalled agent on a loaded host: here,
    this very process) is not lost while the bound lasts; one whose agent's pid is gone from
    this host is lost on the second miss, as before (issue 38.5)."""
    import subprocess
    import sys

    run_id = unique_run_id("confirm")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a pid no process of this host has any more (the dead agent's)
    with etcd.client() as client:
        me = NodeRegistry(client, run_id, "me", "me", timedelta(seconds=30), confirm=timedelta(hours=1))
        stalled = NodeRegistry(client, run_id, "stalled", "stalled", timedelta(seconds=30))
        dead = NodeRegistry(client, run_id, "dead", "dead", timedelta(seconds=30))
        dead.info["pid"] = gone.pid
        try:
            for r in (me, stalled, dead):
                r.claim()
            assert me.lost({"stalled", "dead"}) == set()   # seen alive once: their entries are known
            stalled.leave()   # their keys go as a lapsed lease's would
            dead.leave()
            assert me.lost({"stalled", "dead"}) == set()   # one miss is no loss
            for _ in range(3):
                assert me.lost({"stalled", "dead"}) == {"dead"}   # the stalled one's agent lives
            me.confirm = timedelta(0)   # past the bound: missing is enough
            assert me.lost({"stalled", "dead"}) == {"stalled", "dead"}
        finally:
            me.leave()
