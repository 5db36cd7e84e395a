"""Scenario files: every shipped one loads, typos are rejected, plans are seeded."""

from __future__ import annotations

from datetime import timedelta

import pytest

from resilient.errors import ConfigError
from resilient_chaos.scenario import EMBEDDED_ETCD_KINDS, FAULT_KINDS, load_scenario, scenario_from_dict, shipped_scenarios

SHIPPED = {"kill-worker", "kill-node", "hang", "partition", "etcd-loss", "storage-flaky", "bitflip", "preemption", "scale-down-up", "soak"}


def base(**faults):
    return {"name": "t", "topology": {"nodes": 2, "workers_per_node": 2}, "faults": [dict(kind="kill-worker", target="rank:1", at_step=3, **faults)]}


def test_every_shipped_scenario_loads_and_plans():
    names = {p.stem for p in shipped_scenarios()}
    assert SHIPPED <= names
    for p in shipped_scenarios():
        sc = load_scenario(p)
        assert sc.name == p.stem
        assert sc.training.config == "configs/demo.toml"
        plan = sc.plan()
        assert plan, p
        for f in plan:
            assert f.target.index is not None or f.target.scope in ("etcd", "durable", "all", "rendezvous", "local")


def test_soak_covers_every_kind_and_is_seeded():
    sc = load_scenario("soak")
    kinds = {f.kind for f in sc.faults}
    # first-agent-lost needs the agents' embedded etcd on loopback: its own scenario
    assert kinds == set(FAULT_KINDS) - set(EMBEDDED_ETCD_KINDS)
    a, b = sc.plan(), sc.plan()
    assert a == b
    # 50 of every kind, paced: every round (one fault per kind) has each kind once, a
    # scale-up right after each scale-down, on the node it stopped.
    assert all(f.paced for f in a) and len(a) == 50 * len(kinds)
    n = len(kinds)
    for r in range(50):
        assert {f.kind for f in a[n * r:n * (r + 1)]} == kinds
    for down, up in zip(a, a[1:]):
        if down.kind == "scale-down":
            assert up.kind == "scale-up" and up.target == down.target


def test_unknown_key_rejected_with_hint():
    with pytest.raises(ConfigError, match=r"did you mean 'faults\[0\]\.at_step'"):
        scenario_from_dict(base(at_stpe=4))
    table = base()
    table["faults"][0]["params"] = {"grace_seconds": 3}
    with pytest.raises(ConfigError, match="unknown key 'faults\\[0\\].params.grace_seconds'"):
        scenario_from_dict(table)
    with pytest.raises(ConfigError, match="unknown key 'topology.node'"):
        scenario_from_dict({"name": "t", "topology": {"node": 3}})


def test_invalid_faults_rejected():
    with pytest.raises(ConfigError, match="exactly one of"):
        scenario_from_dict(base(at_seconds=5.0))
    with pytest.raises(ConfigError, match="exactly one of at_step, at_seconds, rate_per_minute, paced"):
        scenario_from_dict(base(paced=True))
    with pytest.raises(ConfigError, match="cannot target"):
        scenario_from_dict({"name": "t", "faults": [{"kind": "kill-worker", "target": "node:0", "at_step": 1}]})
    with pytest.raises(ConfigError, match="out of range"):
        scenario_from_dict({"name": "t", "faults": [{"kind": "kill-worker", "target": "rank:9", "at_step": 1}]})
    with pytest.raises(ConfigError, match="network = 'netns'"):
        scenario_from_dict({"name": "t", "faults": [{"kind": "partition", "target": "node:0", "at_step": 1}]})
    with pytest.raises(ConfigError, match="probability"):
        scenario_from_dict({"name": "t", "topology": {"network": "netns"}, "faults": [{"kind": "packet-loss", "target": "node:0", "at_step": 1}]})


def test_first_agent_lost_needs_the_embedded_etcd():
    lost = {"kind": "first-agent-lost", "target": "etcd", "at_step": 5}
    sc = scenario_from_dict({"name": "t", "topology": {"etcd": "embedded"}, "faults": [lost]})
    (f,) = sc.plan()
    assert f.kind == "first-agent-lost" and f.params.remove_data and f.params.remove_shm
    with pytest.raises(ConfigError, match="needs topology.etcd = 'embedded'"):
        scenario_from_dict({"name": "t", "faults": [lost]})
    with pytest.raises(ConfigError, match="runner's etcd or its proxy"):
        scenario_from_dict({"name": "t", "topology": {"etcd": "embedded"},
                            "faults": [{"kind": "etcd-loss", "target": "etcd:0", "at_step": 1}]})
    with pytest.raises(ConfigError, match="loopback"):
        scenario_from_dict({"name": "t", "topology": {"etcd": "embedded", "network": "netns"}, "faults": [lost]})
    with pytest.raises(ConfigError, match="cannot target"):
        scenario_from_dict({"name": "t", "topology": {"etcd": "embedded"}, "faults": [{**lost, "target": "node:0"}]})


TABLE = {
    "name": "t", "seed": 3, "budget_seconds": 120, "properties": {"recovery_bound_seconds": 20},
    "faults": [
        {"kind": "hang", "target": "rank:random", "rate_per_minute": 6.0, "count": 3},
        {"kind": "kill-worker", "target": "rank:0", "at_step": 7, "recovery_bound_seconds": 5},
    ],
}


def test_plan_order_targets_and_bounds():
    plan = scenario_from_dict(TABLE).plan()
    assert plan[0].kind == "kill-worker" and plan[0].at_step == 7 and plan[0].recovery_bound == timedelta(seconds=5)
    rest = plan[1:]
    assert len(rest) == 3 and all(p.kind == "hang" and p.recovery_bound == timedelta(seconds=20) for p in rest)
    assert [p.at for p in rest] == sorted(p.at for p in rest)
    assert all(0 <= p.target.index < 4 for p in rest)
    assert plan == scenario_from_dict(TABLE).plan()  # same seed, same campaign
    other = scenario_from_dict({**TABLE, "seed": 4}).plan()
    assert [p.at for p in other] != [p.at for p in plan]


def test_paced_faults_come_after_the_timed_ones_in_seeded_rounds():
    table = {**TABLE, "faults": [*TABLE["faults"],
                                 {"kind": "kill-node", "target": "node:random", "paced": True, "count": 3},
                                 {"kind": "scale-down", "target": "node:random", "paced": True, "count": 2},
                                 {"kind": "scale-up", "target": "node:random", "paced": True, "count": 2}]}
    plan = scenario_from_dict(table).plan()
    timed, paced = plan[:4], plan[4:]
    assert not any(f.paced for f in timed) and all(f.paced for f in paced)
    assert [f.kind for f in paced].count("kill-node") == 3 and len(paced) == 7
    assert {f.kind for f in paced[:3]} == {"kill-node", "scale-down", "scale-up"}  # each round: one of each kind
    for down, up in zip(paced, paced[1:]):
        if down.kind == "scale-down":
            assert up.kind == "scale-up" and up.target == down.target
    assert "recovery of the previous fault" in paced[0].describe()
    assert plan == scenario_from_dict(table).plan()
