"""The etcd3 rendezvous backend, store and registration against a real etcd."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib.metadata import entry_points

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from resilient.etcd import LivenessLease, free_port
from resilient_chaos.etcd_testing import embedded_etcd, enable_auth, make_tls_files, unique_run_id
from resilient.rendezvous import (
    Etcd3RendezvousBackend,
    Etcd3Store,
    RendezvousConfigError,
    RendezvousError,
    RendezvousUnavailable,
    create_etcd3_handler,
    register,
)
from resilient.rendezvous.registry import SHARE_STORE_ENV

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60), pytest.mark.usefixtures("restore_share_env", "job_secret")]


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=20)) as c:
        yield c



def _params(etcd_endpoint: str, run_id: str, min_nodes=1, max_nodes=1, **conf) -> RendezvousParameters:
    conf.setdefault("last_call_timeout", 0.5)
    conf.setdefault("join_timeout", 30)
    conf.setdefault("keep_alive_interval", 1)
    return RendezvousParameters("etcd3", etcd_endpoint, run_id, min_nodes, max_nodes, **conf)


# ------------------------------------------------------------ backend
def test_backend_compare_and_swap(client):
    backend = Etcd3RendezvousBackend(client, unique_run_id(), lease_ttl=timedelta(seconds=5))
    assert backend.name == "etcd3" and backend.get_state() is None
    state, token, ok = backend.set_state(b"s1")  # no token: create only
    assert ok and state == b"s1"
    assert backend.get_state() == (b"s1", token)
    # A second creator loses and is handed the winner's state and token.
    assert backend.set_state(b"other") == (b"s1", token, False)
    state2, token2, ok2 = backend.set_state(b"s2", token)
    assert ok2 and token2 != token
    # A writer holding the old token loses.
    assert backend.set_state(b"s3", token) == (b"s2", token2, False)
    assert backend.set_state(b"s3", "not-a-token") == (b"s2", token2, False)
    assert client.get(backend.key).lease == backend.lease.id != 0


def test_backend_state_expires_with_lease_and_heals(client):
    lease = LivenessLease(client, timedelta(seconds=5))
    backend = Etcd3RendezvousBackend(client, unique_run_id(), lease=lease)
    _, token, _ = backend.set_state(b"s1")
    lease.close(revoke=True)  # as if every agent of the run died: the state goes
    assert backend.get_state() is None
    assert backend.set_state(b"s2", token) is None  # stale token on a vanished key
    _, _, ok = backend.set_state(b"fresh")  # a new lease is granted on demand
    assert ok and backend.get_state()[0] == b"fresh"
    # etcd-side expiry (not our revoke) is healed too.
    client._post("/kv/lease/revoke", {"ID": lease.id}, "test revoke")
    state, _, ok = backend.set_state(b"again")
    assert ok and state == b"again"
    lease.close()


# ------------------------------------------------------------ store
def test_store_ops(client):
    store = Etcd3Store(client, f"/{unique_run_id()}/store", timeout=timedelta(seconds=5))
    store.set("a", "1")
    store.set("b", b"\x00\x01")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\x01"
    assert store.check(["a", "b"]) and not store.check(["a", "nope"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x"  # absent + empty expectation: set
    assert store.compare_set("c", "y", "z") == b"x"  # mismatch: current value back
    assert store.compare_set("c", "x", "z") == b"z"
    assert store.compare_set("missing", "e", "d") == b"e"
    assert store.num_keys() == 4
    assert store.delete_key("c") and not store.delete_key("c")
    with pytest.raises(dist.DistStoreError, match="nope"):
        store.wait(["a", "nope"], timedelta(milliseconds=200))
    # torch wraps it in PrefixStore and calls multi_get/multi_set through C++.
    pre = dist.PrefixStore("round.1", store)
    pre.multi_set(["x", "y"], ["1", "2"])
    assert pre.multi_get(["x", "y"]) == [b"1", b"2"]
    threading.Timer(0.2, lambda: store.set("late", "v")).start()
    store.wait(["late"])
    pre.wait(["x"], timedelta(seconds=1))


def test_a_long_store_wait_reads_when_its_key_is_written_not_at_a_rate(etcd):
    """After its first read a wait watches the missing keys: over a 1.5 s wait for a key
    (then for N keys under one prefix, as rank 0 gathers the node ids) it reads a handful
    of times, not every 0.5 s (slow_poll) or 50 ms; the guard still runs at its interval."""
    with etcd.client() as c:
        paths: list[str] = []
        c.on_request = lambda path, seconds: paths.append(path)
        store = Etcd3Store(c, f"/{unique_run_id()}/store", timeout=timedelta(seconds=60))
        store.slow_poll = timedelta(milliseconds=50)   # what a broken watch would poll at
        guarded: list[int] = []
        store.guard = lambda: guarded.append(1)
        threading.Timer(1.5, lambda: store.set("late", "v")).start()
        assert store.get("late") == b"v"
        reads = paths.count("/kv/txn")
        assert 2 <= reads <= 8, paths            # polling at 50 ms: ~15 after the first 100 ms
        assert 2 <= len(guarded) <= 4, guarded   # every 0.5 s (guard_interval)
        paths.clear()
        threading.Timer(1.5, lambda: [store.set(f"node/{r}", str(r)) for r in range(4)]).start()
        assert store.multi_get([f"node/{r}" for r in range(4)]) == [b"0", b"1", b"2", b"3"]
        assert paths.count("/kv/txn") <= 12, paths   # ~5 fast, then one per key written


def test_a_store_wait_reads_every_watched_poll_even_if_its_watch_never_fires(etcd, monkeypatch):
    """Correctness never rests on the watch: one that stays open but quiet (a member cut off
    from its cluster) still lets the wait read every watched_poll, and find its key."""
    from resilient.etcd.watch import Watch

    monkeypatch.setattr(Watch, "wait", lambda self, timeout: (time.sleep(float(timeout)), False)[1])
    with etcd.client() as c:
        store = Etcd3Store(c, f"/{unique_run_id()}/store", timeout=timedelta(seconds=60))
        store.watched_poll = timedelta(seconds=0.3)
        threading.Timer(0.5, lambda: store.set("late", "v")).start()
        assert store.get("late") == b"v"


def test_store_add_is_atomic_across_threads(etcd):
    prefix = f"/{unique_run_id()}/store"

    def bump(_):
        with etcd.client() as c:
            s = Etcd3Store(c, prefix)
            return [s.add("ctr", 1) for _ in range(5)]

    with ThreadPoolExecutor(6) as pool:
        results = sorted(v for vals in pool.map(bump, range(6)) for v in vals)
    assert results == list(range(1, 31))


# ------------------------------------------------------------ registration
def test_register_and_entry_point(etcd):
    register()
    register()  # idempotent
    (ep,) = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd3"]
    # torch 2.13 calls the loaded entry point with no arguments to get the creator.
    assert ep.load()() is create_etcd3_handler
    os.environ.pop(SHARE_STORE_ENV, None)
    handler = get_rendezvous_handler(_params(etcd.endpoint, unique_run_id()))
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.get_backend() == "etcd3"
    # Regression (torch 2.13 shared TCP store trap): the handler opts out.
    assert os.environ[SHARE_STORE_ENV] == "1" and handler.use_agent_store is False
    os.environ.pop(SHARE_STORE_ENV, None)
    shared = create_etcd3_handler(_params(etcd.endpoint, unique_run_id(), share_tcp_store="true"))
    assert shared.use_agent_store is True  # what torch does by default, and what breaks restarts


def test_torchrun_workers_get_the_exit_hook_unless_told_not_to(etcd, monkeypatch):
    from resilient.rendezvous.worker_exit import SITE_DIR

    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    create_etcd3_handler(_params(etcd.endpoint, unique_run_id(), destroy_at_exit="false"))
    assert os.environ["PYTHONPATH"] == "/opt/mine"   # resilient launch's choice: its workers os._exit
    create_etcd3_handler(_params(etcd.endpoint, unique_run_id()))
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/opt/mine"]


def test_bad_config_is_typed(etcd):
    with pytest.raises(RendezvousConfigError, match="seconds"):
        create_etcd3_handler(_params(etcd.endpoint, unique_run_id(), join_timeout="soon"))
    with pytest.raises(RendezvousConfigError, match="password"):
        create_etcd3_handler(_params(etcd.endpoint, unique_run_id(), username="u"))
    with pytest.raises(RendezvousConfigError, match="rdzv-endpoint"):
        create_etcd3_handler(_params("", unique_run_id()))


def test_tls_and_password_from_rdzv_conf(tmp_path, monkeypatch):
    """The --rdzv-conf keys reach the client: TLS files, username, password (or its env var)."""
    ca, cert, key = make_tls_files(tmp_path)
    # Client certificates are covered in test_etcd_server; etcd's gateway refuses
    # requests carrying both a client certificate and a password token.
    with embedded_etcd(cert_file=cert, key_file=key) as server:
        with server.client(ca_cert=ca) as admin:
            enable_auth(admin, "s3cret")
        tls = dict(ca_cert=ca, username="root")
        monkeypatch.setenv("RESILIENT_ETCD_PASSWORD", "s3cret")
        handler = create_etcd3_handler(_params(server.endpoint, unique_run_id(), **tls))
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        handler.shutdown()
        with pytest.raises(RendezvousError, match="refused user"):
            create_etcd3_handler(_params(server.endpoint, unique_run_id(), password="wrong", **tls))


@pytest.mark.timeout(30)
def test_unreachable_etcd_fails_fast():
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousUnavailable) as info:
        create_etcd3_handler(_params(endpoint, unique_run_id(), connect_timeout=0.5))
    assert endpoint in str(info.value) and "etcdctl" in str(info.value)
    assert isinstance(info.value, RendezvousConnectionError)  # what torch's agent expects


# ------------------------------------------------------------ rendezvous
def _join(endpoint: str, run_id: str, n: int, barrier: threading.Barrier | None = None):
    handler = create_etcd3_handler(_params(endpoint, run_id, n, n))
    if barrier is not None:
        barrier.wait()
    info = handler.next_rendezvous()
    state = handler._state_holder.state  # the membership this node agreed to
    return handler, info, state.round, dict(state.participants)


def test_racing_handlers_agree_on_one_membership(etcd):
    """6 agents race one round: one membership, ranks 0..5 each exactly once."""
    n, run_id = 6, unique_run_id("race")
    barrier = threading.Barrier(n)
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: _join(etcd.endpoint, run_id, n, barrier), range(n)))
    try:
        memberships = {(rnd, frozenset(p.items())) for _, _, rnd, p in results}
        assert len(memberships) == 1
        ranks = sorted(info.rank for _, info, _, _ in results)
        assert ranks == list(range(n)) and {info.world_size for _, info, _, _ in results} == {n}
        # All agree on the rank-0 address published through the etcd store.
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                    for _, i, _, _ in results}) == 1
    finally:
        for handler, *_ in results:
            handler.shutdown()


def test_last_call_race_never_splits_a_round(etcd):
    """6 agents arrive staggered around a short last call (min 2, max 6).

    Whoever gets in agrees on one membership with ranks 0..k-1; whoever
    arrives after the round closed waits (and here times out), never forming
    a second membership for the same round.
    """
    n, run_id = 6, unique_run_id("lastcall")
    barrier = threading.Barrier(n)

    def agent(i: int):
        handler = create_etcd3_handler(_params(
            etcd.endpoint, run_id, 2, n, last_call_timeout=0.3, join_timeout=3))
        barrier.wait()
        threading.Event().wait(0.25 * i)  # staggered arrivals straddle the last call
        try:
            info = handler.next_rendezvous()
        except RendezvousTimeoutError:
            return handler, None, None, None
        state = handler._state_holder.state
        return handler, info, state.round, dict(state.participants)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(agent, range(n)))
    try:
        joined = [r for r in results if r[1] is not None]
        assert len(joined) >= 2
        memberships = {(rnd, frozenset(p.items())) for _, _, rnd, p in joined}
        assert len(memberships) == 1
        ((_, members),) = memberships
        assert len(members) == len(joined)
        assert sorted(info.rank for _, info, _, _ in joined) == list(range(len(joined)))
    finally:
        for handler, *_ in results:
            handler.shutdown()


def test_rendezvous_rides_through_etcd_restart():
    """One agent waits in a round while etcd restarts; the second joins after."""
    with embedded_etcd() as server:
        run_id = unique_run_id("restart")
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_join, server.endpoint, run_id, 2)
            with server.client() as c:  # wait until the first agent is in the state
                for _ in range(200):
                    if c.get_prefix(f"/resilient/rdzv/{run_id}/state"):
                        break
                    threading.Event().wait(0.05)
            server.restart()
            second = pool.submit(_join, server.endpoint, run_id, 2)
            results = [first.result(timeout=40), second.result(timeout=40)]
        try:
            assert results[0][2:] == results[1][2:]
            assert sorted(r[1].rank for r in results) == [0, 1]
        finally:
            for handler, *_ in results:
                handler.shutdown()


def test_workers_reach_a_secured_etcd_as_the_agent_does(tmp_path, monkeypatch):
    """The store info an agent hands its workers carries the TLS/auth keys of --rdzv-conf
    (never the password: that travels in the inherited environment)."""
    from resilient.launch import worker_etcd_conf
    from resilient.snapshot.tiers import StoreInfo

    ca, cert, key = make_tls_files(tmp_path)
    with embedded_etcd(cert_file=cert, key_file=key) as server:
        with server.client(ca_cert=ca) as admin:
            enable_auth(admin, "s3cret")
        monkeypatch.delenv("RESILIENT_ETCD_PASSWORD", raising=False)
        conf = worker_etcd_conf({"ca_cert": ca, "username": "root", "password": "s3cret", "join_timeout": "9"})
        assert conf == {"ca_cert": ca, "username": "root"}
        info = StoreInfo(base=str(tmp_path), run_id="r", node="n", etcd=server.endpoint,
                         secret_file=str(tmp_path / "s"), etcd_conf=conf)
        worker_view = StoreInfo(**__import__("json").loads(info.to_env()))
        with worker_view.client() as c:  # password from the environment the agent set
            c.put("/t/k", "v")
            assert c.get("/t/k").value == b"v"
        monkeypatch.setenv("RESILIENT_ETCD_PASSWORD", "wrong")
        with pytest.raises(Exception, match="refused user|auth"):
            with worker_view.client() as c:
                c.put("/t/k", "w")


def test_event_records_name_the_same_method_without_inspect_stack():
    """register() swaps torch's slow get_method_name for an equivalent: same names."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from resilient.rendezvous import register

    register()

    def torch_original(depth=2):  # what torch 2.13 does
        return inspect.stack()[depth].function if len(inspect.stack()) > depth else "no_method_name"

    class Handler:
        def _record(self):
            return dynamic_rendezvous.get_method_name(), torch_original()

        def next_rendezvous(self):
            return self._record()

    assert Handler().next_rendezvous() == ("next_rendezvous", "next_rendezvous")
    assert dynamic_rendezvous.get_method_name(10_000) == "no_method_name"
