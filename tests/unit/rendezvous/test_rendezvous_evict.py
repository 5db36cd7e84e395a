"""A dead member leaves the rendezvous on proof, and joins poll fast (resilient/rendezvous/handler.py).

Against a real etcd. The keep-alive settings here are so long (expiry after
3 minutes) that only the eviction can explain a survivor re-forming alone
within the join timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from resilient.agent.membership import NodeRegistry, refuses_connections
from resilient_chaos.etcd_testing import unique_run_id
from resilient.rendezvous import create_etcd3_handler, handler as handler_module

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120), pytest.mark.usefixtures("restore_share_env", "job_secret")]

SLOW_KEEP_ALIVE = {"keep_alive_interval": 60, "keep_alive_max_attempt": 3}   # a lapse takes 180 s


def _handler(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf):
    conf = {"last_call_timeout": 0.5, "join_timeout": 60, **SLOW_KEEP_ALIVE, **conf}
    return create_etcd3_handler(RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf))


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_member_proven_dead_is_evicted_and_the_survivor_reforms_alone(etcd):
    run_id = unique_run_id("evict")
    a, b = _handler(etcd.endpoint, run_id, 1, 2), _handler(etcd.endpoint, run_id, 1, 2)
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), (a, b)))
        assert {i.world_size for i in infos} == {2}
        b._stop_heartbeats()  # b is killed: no more keep-alives, no exit
        # A prober that proves nothing evicts nothing.
        assert a.evict(lambda names: set()) == []
        asked = []

        def b_is_dead(names):
            asked.append(names)
            return {b.node_desc} & set(names)

        assert a.evict(b_is_dead) == [b.node_desc]
        assert asked == [[b.node_desc]]   # a never probes itself
        # Its keep-alive would lapse in 180 s; the next round forms now, without it.
        info = a.next_rendezvous()
        assert info.world_size == 1 and info.rank == 0
        assert b._this_node not in a._state_holder.state.participants
    finally:
        for h in (a, b):
            h._stop_heartbeats()


def test_joins_poll_the_state_fast(etcd, monkeypatch):
    """The join loop's 1 s waits become ``poll`` waits while joining, and only then."""
    slept = []

    def record(seconds):
        slept.append(seconds)
        time.sleep(seconds if isinstance(seconds, (int, float)) else 0.1)

    monkeypatch.setattr(handler_module, "_torch_delay", record)
    run_id = unique_run_id("poll")
    # Two of two must join: the first waits (polls) until the second arrives.
    a, b = _handler(etcd.endpoint, run_id, 2, 2, poll_interval=0.05), _handler(etcd.endpoint, run_id, 2, 2)
    try:
        first = threading.Thread(target=a.next_rendezvous, daemon=True)
        first.start()
        while not any(s == 0.05 for s in slept) and first.is_alive():
            time.sleep(0.01)
        b.next_rendezvous()
        first.join(30)
        assert not first.is_alive()
        assert 0.05 in slept and 1 not in slept, slept
        # Outside a join torch's own waits are left alone.
        handler_module._delay(1)
        assert slept[-1] == 1
    finally:
        for h in (a, b):
            h._stop_heartbeats()


def test_registry_proves_a_node_dead_only_when_its_port_refuses(etcd):
    run_id = unique_run_id("proof")
    with etcd.client() as client, socket.create_server(("127.0.0.1", 0)) as listening:
        alive_port, dead_port = listening.getsockname()[1], _closed_port()
        me = NodeRegistry(client, run_id, "me", "r0", timedelta(seconds=30))
        me.update(rdzv="host_1_0", store="127.0.0.1:1")  # itself: never probed
        for node, rdzv, store in (("up", "host_2_0", f"127.0.0.1:{alive_port}"),
                                  ("down", "host_3_0", f"127.0.0.1:{dead_port}"),
                                  ("no-store", "host_4_0", "")):
            NodeRegistry(client, run_id, node, "r1", timedelta(seconds=30)).update(rdzv=rdzv, store=store)
        names = ["host_1_0", "host_2_0", "host_3_0", "host_4_0", "host_5_0"]  # host_5_0: not registered
        assert me.proven_dead(names) == {"host_3_0"}
        # Knowing its round (names and node ids by rank), a node reads the named entries alone.
        other = NodeRegistry(client, run_id, "other", "r0", timedelta(seconds=30))
        other.update(rdzv="host_6_0", store="127.0.0.1:1")
        other.know_round(["host_6_0", "host_2_0", "host_3_0", "host_4_0"], ["other", "up", "down", "no-store"])
        paths: list[str] = []
        client.on_request = lambda path, seconds: paths.append(path)
        try:
            assert other.proven_dead(["host_2_0", "host_3_0", "host_4_0"]) == {"host_3_0"}
        finally:
            client.on_request = None
        assert paths == ["/kv/txn"]  # one read of four keys, not the whole registry
    assert refuses_connections(f"127.0.0.1:{_closed_port()}", timedelta(seconds=1))
    assert not refuses_connections("not-an-address", timedelta(seconds=1))
