"""Rounds that break or fill up, against a real etcd: the two failure modes the
chaos soak found in torch's DynamicRendezvousHandler (see resilient/rendezvous/handler.py).

- a member of a just-completed round dies before publishing what the others
  wait for → the survivors stop waiting and form the next round;
- a node left in the wait list of a full round → the healthy members are not
  told to restart for it (no churn), until the round has room again.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from resilient_chaos.etcd_testing import unique_run_id
from resilient.rendezvous import Etcd3Store, RendezvousRoundLost, create_etcd3_handler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120), pytest.mark.usefixtures("restore_share_env", "job_secret")]

# Generous bounds: they separate "noticed the lost round" from "waited out the
# store timeout" (STORE_TIMEOUT), not fast from slow.
STORE_TIMEOUT = 120
LOST_BOUND = 45



def _handler(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf):
    conf = {"last_call_timeout": 0.5, "join_timeout": 60, "keep_alive_interval": 0.5,
            "keep_alive_max_attempt": 3, "store_timeout": STORE_TIMEOUT, **conf}
    return create_etcd3_handler(RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf))


def _die(handler) -> None:
    """What a node killed with SIGKILL leaves behind: no more keep-alives, no exit op."""
    handler._stop_heartbeats()


class _Died(Exception):
    pass


def test_store_wait_ends_when_the_guard_reports_a_lost_round(etcd):
    with etcd.client() as client:
        store = Etcd3Store(client, f"/t/{unique_run_id('guard')}/", timeout=timedelta(seconds=STORE_TIMEOUT))
        store.guard_interval = timedelta(seconds=0.05)
        calls = []
        store.guard = lambda: (calls.append(1), "member n0 stopped sending keep-alives" if len(calls) > 2 else None)[1]
        t0 = time.monotonic()
        with pytest.raises(RendezvousRoundLost, match="n0 stopped"):
            store.get("MASTER_ADDR")
        assert time.monotonic() - t0 < LOST_BOUND
        # Through torch's PrefixStore (C++), as torch's handler uses it, the type survives.
        calls.clear()
        with pytest.raises(RendezvousRoundLost):
            dist.PrefixStore("torch.rendezvous.x.1", store).get("MASTER_ADDR")
        # Without a guard, or while it sees nothing wrong, a present key is simply read.
        store.guard = lambda: None
        store.set("k", b"v")
        assert store.get("k") == b"v"


def test_rank0_dying_right_after_the_round_completes_does_not_wedge_the_others(etcd):
    """3 nodes complete a round; rank 0 dies before publishing MASTER_ADDR.
    The others give up on that round (RendezvousRoundLost) long before the
    store timeout, and the two of them form the next round."""
    run_id = unique_run_id("rank0dies")
    handlers = [_handler(etcd.endpoint, run_id, 2, 3) for _ in range(3)]
    # Rank 0 alone writes MASTER_ADDR: whichever handler that is "dies" right there.
    for h in handlers:
        store = h._store
        real_set = store.set

        def set_or_die(key, value, h=h, real_set=real_set):
            if key.endswith("MASTER_ADDR"):
                _die(h)
                raise _Died()
            return real_set(key, value)

        store.set = set_or_die
    barrier = threading.Barrier(3)

    def first_round(h):
        barrier.wait()
        t0 = time.monotonic()
        try:
            h.next_rendezvous()
            return "joined", time.monotonic() - t0
        except _Died:
            return "died", time.monotonic() - t0
        except RendezvousRoundLost:
            return "lost", time.monotonic() - t0

    try:
        with ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(first_round, handlers))
        assert sorted(o for o, _ in outcomes) == ["died", "lost", "lost"], outcomes
        assert all(s < LOST_BOUND for o, s in outcomes if o == "lost"), outcomes
        survivors = [h for h, (o, _) in zip(handlers, outcomes) if o == "lost"]
        for h in survivors:   # the next round must not trip over the dead node either
            h._store.set = type(h._store).set.__get__(h._store)
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), survivors))
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
    finally:
        for h in handlers:
            h._stop_heartbeats()


def test_a_node_waiting_on_a_full_round_does_not_make_it_restart(etcd):
    """Round {a, b, c} is full (max 3); d is left in the wait list (as a race of
    restarts leaves it). torch would count d and make a, b, c restart for a
    node the round cannot admit; ours counts it once a member is gone."""
    run_id = unique_run_id("churn")
    # A long last call: the round waits for all three (it completes at max at once).
    # Keep-alives that tolerate a loaded test machine: only the member we kill may look dead.
    conf = {"last_call_timeout": 20, "keep_alive_interval": 1, "keep_alive_max_attempt": 8}
    members = [_handler(etcd.endpoint, run_id, 2, 3, **conf) for _ in range(3)]
    spare = _handler(etcd.endpoint, run_id, 2, 3, **conf)
    try:
        with ThreadPoolExecutor(3) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), members))
        assert {i.world_size for i in infos} == {3}
        waiting = threading.Thread(target=lambda: _swallow(spare.next_rendezvous), daemon=True)
        waiting.start()
        holder = members[0]._state_holder

        def in_a_list():
            with members[0]._heartbeat_lock:
                holder.sync()
                s = holder.state
                return spare._this_node in s.redundancy_list or spare._this_node in s.wait_list

        _wait(in_a_list, 30, "the spare to wait on the full round")
        # Put the spare where the restart race leaves it: in the wait list of the full round.
        # The write is a compare-and-set: it loses to a concurrent keep-alive of another
        # handler (then the state is re-read without it), so try until it sticks.
        def moved_to_wait_list():
            with members[0]._heartbeat_lock:
                holder.sync()
                if spare._this_node not in holder.state.wait_list:
                    holder.state.redundancy_list.discard(spare._this_node)
                    holder.state.wait_list.add(spare._this_node)
                    holder.mark_dirty()
                    holder.sync()
                return spare._this_node in holder.state.wait_list

        _wait(moved_to_wait_list, 30, "the spare in the wait list of the full round")
        # (torch caches the state for 1 s)
        _wait(lambda: DynamicRendezvousHandler.num_nodes_waiting(members[1]) == 1, 30, "torch to count it (the churn)")
        st = holder.state
        assert [h.num_nodes_waiting() for h in members] == [0, 0, 0], (st.complete, st.participants, st.wait_list, st.round)
        # A member dies: now the round has room, and the spare counts.
        _die(members[2])
        _wait(lambda: members[0].num_nodes_waiting() == 1, 30, "the spare to count once a member is gone")
    finally:
        for h in [*members, spare]:
            h._stop_heartbeats()


def _swallow(fn):
    try:
        fn()
    except Exception:
        pass


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
