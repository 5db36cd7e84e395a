"""The etcd3 backend's answer to a lost compare-and-swap (issue 25): it backs off (jittered,
doubling per consecutive loss, capped) and returns the state as it is *after* the wait, so
torch's handler retries against the newest revision instead of racing again at once."""

from __future__ import annotations

import pickle
from datetime import timedelta

import pytest

from resilient_chaos.etcd_testing import unique_run_id
from resilient.rendezvous import Etcd3RendezvousBackend

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]

SECRET = b"b" * 32


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=20)) as c:
        yield c


def test_a_lost_swap_backs_off_and_answers_the_newest_state(client, monkeypatch):
    run_id = unique_run_id()
    a, b, c = (Etcd3RendezvousBackend(client, run_id, lease_ttl=timedelta(seconds=10), secret=SECRET)
               for _ in range(3))
    first = a.set_state(pickle.dumps("a1"))
    assert first is not None and first[2]
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the backoff's wait; a third node writes meanwhile
        waits.append(seconds)
        _, token = c.get_state()
        assert c.set_state(pickle.dumps(f"c{len(waits)}"), token)[2]

    monkeypatch.setattr("resilient.rendezvous.etcd3_backend._sleep", sleep)
    state, token, won = b.set_state(pickle.dumps("b1"), None)  # stale: a wrote first
    assert not won and pickle.loads(state) == "c1"           # what is there after the wait
    assert token == client.get(b.key).mod_revision
    b.set_state(pickle.dumps("b2"), first[1])                  # stale again: a longer window
    assert len(waits) == 2 and b._losses == 2
    assert 0 <= waits[0] <= b.backoff_base.total_seconds() and 0 <= waits[1] <= 2 * b.backoff_base.total_seconds()
    _, token = b.get_state()
    assert b.set_state(pickle.dumps("b3"), token)[2] and b._losses == 0  # a win resets the window
    for _ in range(20):
        b._back_off()
    assert max(waits) <= b.backoff_cap.total_seconds()
