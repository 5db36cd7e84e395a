"""The keyed rendezvous (a key per node, resilient.rendezvous.keyed) against a real etcd:
one membership per round however the nodes race, re-forms, waiters and spares, an etcd
restart, a dead job's leftovers, and records that fail authentication."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError, RendezvousTimeoutError

from resilient_chaos.etcd_testing import embedded_etcd, unique_run_id
from resilient.rendezvous import RendezvousConfigError, RendezvousStateCorrupt, create_etcd3_handler
from resilient.rendezvous.keyed import KeyedRendezvousHandler

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90), pytest.mark.usefixtures("restore_share_env", "job_secret")]


def _handler(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf) -> KeyedRendezvousHandler:
    conf = {"last_call_timeout": 0.3, "join_timeout": 20, "poll_interval": 0.02, "handler": "keys", **conf}
    h = create_etcd3_handler(RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf))
    assert isinstance(h, KeyedRendezvousHandler)
    return h


def _rendezvous(handlers: list, stagger: float = 0.0) -> list:
    """Every handler's next_rendezvous at once (staggered by ``stagger`` s each); its info,
    or the exception it raised."""
    barrier = threading.Barrier(len(handlers))

    def one(i: int):
        barrier.wait()
        threading.Event().wait(stagger * i)
        try:
            return handlers[i].next_rendezvous()
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            return e

    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(one, range(len(handlers))))


def _one_membership(handlers: list, infos: list) -> list[str]:
    """The joined nodes agree on one round and one member list, ranks 0..k-1 once each."""
    joined = [(h, i) for h, i in zip(handlers, infos) if not isinstance(i, Exception)]
    rounds = {h._joined[0] for h, _ in joined}
    members = {tuple(h._joined[1]) for h, _ in joined}
    assert len(rounds) == 1 and len(members) == 1, (rounds, members)
    (names,) = members
    assert sorted(i.rank for _, i in joined) == list(range(len(joined))) == list(range(len(names)))
    assert {i.world_size for _, i in joined} == {len(names)}
    for h, i in joined:
        assert names[i.rank] == h.node_desc
    return list(names)


def _shutdown(handlers: list) -> None:
    for h in handlers:
        h.shutdown()


def test_racing_nodes_agree_on_one_membership(etcd):
    run_id = unique_run_id("keyed-race")
    hs = [_handler(etcd.endpoint, run_id, 6, 6) for _ in range(6)]
    try:
        infos = _rendezvous(hs)
        _one_membership(hs, infos)
        assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
    finally:
        _shutdown(hs)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(2, 6), min_nodes=st.integers(1, 3), stagger=st.sampled_from([0.0, 0.05, 0.15]))
def test_staggered_arrivals_never_split_a_round(etcd, n, min_nodes, stagger):
    """Arrivals straddling the last call: whoever gets in agrees on one membership; whoever
    came after the round closed waits for a round after it (and here times out)."""
    run_id = unique_run_id("keyed-lastcall")
    hs = [_handler(etcd.endpoint, run_id, min(min_nodes, n), n, last_call_timeout=0.1, join_timeout=1.5)
          for _ in range(n)]
    try:
        infos = _rendezvous(hs, stagger)
        assert all(isinstance(i, RendezvousTimeoutError) for i in infos if isinstance(i, Exception)), infos
        assert len(_one_membership(hs, infos)) >= min(min_nodes, n)
    finally:
        _shutdown(hs)


def test_lost_member_then_re_form_without_it(etcd):
    run_id = unique_run_id("keyed-reform")
    hs = [_handler(etcd.endpoint, run_id, 3, 4) for _ in range(4)]
    try:
        _one_membership(hs, _rendezvous(hs))
        first = hs[0]._joined[0]
        dead = hs[3].node_desc
        assert hs[0].evict(lambda names: {dead} | {"not-a-member"}) == [dead]
        assert all("left or were evicted" in h.round_lost() for h in hs[:3])
        survivors = hs[:3]
        names = _one_membership(survivors, _rendezvous(survivors))
        assert dead not in names and len(names) == 3
        assert {h._joined[0] for h in survivors} == {first + 1}
        assert [h.round_lost() for h in survivors] == [None] * 3
    finally:
        _shutdown(hs)


def test_a_member_that_comes_back_takes_everyone_to_the_next_round(etcd):
    """An agent restarting its workers calls next_rendezvous again: the round is abandoned,
    the other members see it (num_nodes_waiting, round_lost) and re-form with it."""
    run_id = unique_run_id("keyed-comeback")
    hs = [_handler(etcd.endpoint, run_id, 3, 3) for _ in range(3)]
    try:
        _one_membership(hs, _rendezvous(hs))
        with ThreadPoolExecutor(1) as pool:
            back = pool.submit(hs[0].next_rendezvous)
            for _ in range(200):
                if hs[1].num_nodes_waiting() > 0:
                    break
                threading.Event().wait(0.02)
            assert hs[1].num_nodes_waiting() == 1 and "replaced by round 1" in hs[2].round_lost()
            rest = _rendezvous(hs[1:])
            infos = [back.result(timeout=20), *rest]
        _one_membership(hs, infos)
        assert {h._joined[0] for h in hs} == {1}
    finally:
        _shutdown(hs)


def test_a_late_node_waits_when_there_is_room_and_stands_by_when_full(etcd):
    run_id = unique_run_id("keyed-late")
    hs = [_handler(etcd.endpoint, run_id, 2, 3) for _ in range(2)]
    late = _handler(etcd.endpoint, run_id, 2, 3)
    try:
        _one_membership(hs, _rendezvous(hs))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(late.next_rendezvous)
            for _ in range(200):  # the round has room: the members are asked to re-form for it
                if hs[0].num_nodes_waiting() == 1:
                    break
                threading.Event().wait(0.02)
            assert [h.num_nodes_waiting() for h in hs] == [1, 1]
            rest = _rendezvous(hs)
            infos = [*rest, waiting.result(timeout=20)]
        assert len(_one_membership([*hs, late], infos)) == 3
        # Now full: a fourth node is a spare, counted by nobody, and leaves when the job ends.
        spare = _handler(etcd.endpoint, run_id, 2, 3)
        with ThreadPoolExecutor(1) as pool:
            standing = pool.submit(spare.next_rendezvous)
            threading.Event().wait(0.5)
            assert [h.num_nodes_waiting() for h in [*hs, late]] == [0, 0, 0]
            hs[0].shutdown()
            with pytest.raises(RendezvousGracefulExitError):
                standing.result(timeout=20)
    finally:
        _shutdown([*hs, late])


def test_a_spare_takes_the_seat_of_a_lost_member(etcd):
    run_id = unique_run_id("keyed-spare")
    hs = [_handler(etcd.endpoint, run_id, 2, 2) for _ in range(2)]
    spare = _handler(etcd.endpoint, run_id, 2, 2)
    try:
        _one_membership(hs, _rendezvous(hs))
        with ThreadPoolExecutor(1) as pool:
            standing = pool.submit(spare.next_rendezvous)
            threading.Event().wait(0.3)
            hs[1].leave()  # preempted: its agent leaves the round
            assert hs[0].round_lost()
            infos = [hs[0].next_rendezvous(), standing.result(timeout=20)]
        assert sorted(_one_membership([hs[0], spare], infos)) == sorted([hs[0].node_desc, spare.node_desc])
    finally:
        _shutdown([*hs, spare])


def test_a_dead_job_s_round_is_abandoned_by_a_new_one(etcd):
    """Same run id, the old job's agents all dead (their leases gone): the new nodes do not
    wait forever behind the old membership."""
    run_id = unique_run_id("keyed-stale")
    old = [_handler(etcd.endpoint, run_id, 2, 2) for _ in range(2)]
    _one_membership(old, _rendezvous(old))
    for h in old:
        h.lease.close(revoke=True)  # as if every agent died: their join keys go with their leases
    new = [_handler(etcd.endpoint, run_id, 2, 2) for _ in range(2)]
    try:
        names = _one_membership(new, _rendezvous(new))
        assert set(names) == {h.node_desc for h in new}
    finally:
        _shutdown(new)


def test_rides_through_an_etcd_restart():
    with embedded_etcd() as server:
        run_id = unique_run_id("keyed-restart")
        hs = [_handler(server.endpoint, run_id, 2, 2) for _ in range(2)]
        try:
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(hs[0].next_rendezvous)
                threading.Event().wait(0.3)  # the first node is in and polling
                server.restart()
                second = pool.submit(hs[1].next_rendezvous)
                infos = [first.result(timeout=40), second.result(timeout=40)]
            _one_membership(hs, infos)
        finally:
            _shutdown(hs)


def test_a_members_waiting_check_says_etcd_is_gone_within_its_own_retry_not_the_clients():
    """An agent asks for waiting nodes at every healthy check; blocked in that read for the
    client's whole outage budget, it could not see meanwhile that the control plane left with
    its owner. The check retries for ``waiting_check_retry`` (5 s), whatever the client's."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    with embedded_etcd() as server:
        run_id = unique_run_id("keyed-gone")
        hs = [_handler(server.endpoint, run_id, 2, 2, retry_timeout=3600) for _ in range(2)]
        try:
            _one_membership(hs, _rendezvous(hs))
            assert hs[0].num_nodes_waiting() == 0
            server.kill()
            time.sleep(0.1)  # past the answer kept for one poll interval
            with pytest.raises(RendezvousError, match="reading rendezvous round"):
                hs[0].num_nodes_waiting()   # an hour of the client's retries would time the test out
        finally:
            server.restart()
            _shutdown(hs)


def test_a_forged_membership_is_refused_not_used(etcd):
    run_id = unique_run_id("keyed-forged")
    h = _handler(etcd.endpoint, run_id, 2, 2, join_timeout=5)
    with etcd.client() as c:
        c.put(f"/resilient/rdzv/{run_id}/k/0/done", '{"members": ["evil_1_0", "x_2_0"], "mac": "00"}')
    try:
        with pytest.raises(RendezvousStateCorrupt, match="fails authentication"):
            h.next_rendezvous()
    finally:
        h.shutdown()


def test_an_unknown_handler_is_a_config_error(etcd):
    with pytest.raises(RendezvousConfigError, match="handler='kyes'"):
        create_etcd3_handler(RendezvousParameters("etcd3", etcd.endpoint, "x", 1, 1, handler="kyes"))


def test_poll_slows_with_the_fleet():
    """The fleet's polling load stays near 1/poll_per_node requests a second."""
    from resilient.rendezvous.keyed import KeyedSettings

    s = KeyedSettings(1, 512, poll=timedelta(seconds=0.1), poll_per_node=timedelta(milliseconds=1))
    assert 512 / (s.poll + 512 * s.poll_per_node).total_seconds() < 1000


def test_waiting_nodes_read_when_the_round_closes_not_at_the_closers_rate(etcd):
    """Only the round's closer (its oldest joiner) polls at the full rate to count arrivals for
    its last call; the others watch the round's membership key and read when it is written
    (else watched_slowdown times less often). All four still agree on one membership."""
    run_id = unique_run_id("keyed-watch")
    hs = [_handler(etcd.endpoint, run_id, 2, 8, last_call_timeout=1.5) for _ in range(4)]
    reads = [[] for _ in hs]
    for h, mine in zip(hs, reads):
        h.client.on_request = lambda path, seconds, mine=mine: mine.append(path)
        # a non-closer then polls every ~24 s: only the watch on the round's membership
        # brings it back within the 1.5 s last call and a few polls
        h.settings.watched_slowdown = 1000
    try:
        start = time.monotonic()
        infos = _rendezvous(hs)
        assert time.monotonic() - start < 15, "the non-closers slept out their slowed poll"
        names = _one_membership(hs, infos)
        polls = sorted(r.count("/kv/txn") for r in reads)
        # the closer at the full rate; polling alike, all four were within a few of each other
        assert polls[-1] >= 2 * polls[-2], (names, polls)
    finally:
        _shutdown(hs)


def test_a_members_asks_for_waiting_nodes_read_etcd_once_per_poll_interval(etcd):
    """torch's agent asks at every healthy check (0.1 s) on every node: the handler reads
    etcd at most once per its poll interval and answers from that read in between, and a
    node that arrives is counted once the interval has passed."""
    run_id = unique_run_id("keyed-asks")
    hs = [_handler(etcd.endpoint, run_id, 2, 3) for _ in range(2)]
    late = _handler(etcd.endpoint, run_id, 2, 3)
    try:
        _one_membership(hs, _rendezvous(hs))
        member = hs[0]
        member.settings.poll = timedelta(seconds=3)
        interval = 3 + 2 * member.settings.poll_per_node.total_seconds()   # 3 s + 1 ms per member
        reads: list[str] = []
        member.client.on_request = lambda path, seconds: reads.append(path)
        asked = time.monotonic()
        assert member.num_nodes_waiting() == 0 and reads.count("/kv/txn") == 1, reads
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(late.next_rendezvous)
            answers = []
            while time.monotonic() - asked < interval - 0.5:   # ten healthy checks a second
                answers.append(member.num_nodes_waiting())
                threading.Event().wait(0.1)
            assert reads.count("/kv/txn") == 1 and set(answers) == {0}, (reads, answers)
            wait_prefix = f"{member.base}/{member._joined[0]}/wait/"
            for _ in range(400):   # the late node has put its wait key
                if member.client.get_prefix(wait_prefix):
                    break
                threading.Event().wait(0.05)
            threading.Event().wait(max(0.0, asked + interval - time.monotonic()))
            assert member.num_nodes_waiting() == 1 and reads.count("/kv/txn") == 2, reads
            member.settings.poll = timedelta(seconds=0.02)
            infos = [*_rendezvous(hs), waiting.result(timeout=20)]
        assert len(_one_membership([*hs, late], infos)) == 3
    finally:
        _shutdown([*hs, late])
