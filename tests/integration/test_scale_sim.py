"""The control-plane simulator (bench/scale.py) at 8 and 32 nodes against a real etcd:
every node admitted in one round, a killed node's survivors re-formed in one round with
O(1) etcd writes each, versions committed, and etcd writes per committed version the same
at both sizes (etcd's own counters)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launchutil import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import scale  # noqa: E402

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]

VERSIONS = 5


def run(etcd, n: int, tmp_path: Path) -> dict:
    # keep_alive 60 s: no rendezvous heartbeat lands in the versions phase, so its writes are
    # the commit protocol's alone (a lost node is evicted on proof, not by keep-alive expiry).
    args = scale.build_parser().parse_args([
        "--versions", str(VERSIONS), "--procs", "2", "--idle", "0.5", "--keep-alive", "60",
        "--lost-fraction", "0", "--settle", "1.5", "--join-timeout", "90", "--out", str(tmp_path)])
    return scale.simulate(n, etcd.endpoint, etcd.client_url + "/metrics", [etcd.pid], args)


def test_32_nodes_form_reform_and_commit_at_a_cost_independent_of_n(etcd, tmp_path):
    got = {n: run(etcd, n, tmp_path) for n in (8, 32)}
    for n, r in got.items():
        first = r["first_round"]
        assert first["joined"] == n and first["errors"] == 0 and first["rounds"] == [0], first
        assert first["worlds"] == [n] and first["ranks_unique"]
        again = r["reform_1"]
        assert again["errors"] == 0 and again["joined"] == n - 1 and again["worlds"] == [n - 1], again
        assert again["ranks_unique"] and len(again["rounds"]) == 1 and again["rounds"][0] > 0
        # The keyed rendezvous: a join put per survivor, one round bump, one membership (and
        # the round store's address keys), never a queue of retried writes of one shared key.
        assert again["writes"] <= 3 * n, again
        v = r["versions"]
        assert v["committed"] == VERSIONS, v
    # one commit txn (2 puts) per version (the leader's record, once per attempt, came with
    # the unmeasured warm-up version)
    assert got[8]["versions"]["writes"] == got[32]["versions"]["writes"] == 2 * VERSIONS
