"""EtcdClient against a real etcd: KV, compare-and-swap, leases, unreachable endpoints."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from resilient.etcd import (
    EtcdClient,
    EtcdError,
    EtcdLeaseExpired,
    EtcdUnavailable,
    free_port,
    parse_endpoints,
)
from resilient_chaos.etcd_testing import unique_run_id

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


@pytest.fixture
def ns():
    return "/" + unique_run_id("kv") + "/"


def _wait_until(pred, bound: timedelta, poll: float = 0.05) -> bool:
    end = time.monotonic() + bound.total_seconds()
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll)
    return pred()


def test_parse_endpoints():
    assert parse_endpoints("a:1, b ,https://c:3,[::1]:4") == [
        ("", "a", 1), ("", "b", 2379), ("https", "c", 3), ("", "::1", 4)]
    with pytest.raises(EtcdError, match="HOST:PORT"):
        parse_endpoints(" , ")
    with pytest.raises(EtcdError, match="scheme"):
        parse_endpoints("ftp://x:1")


def test_kv_and_prefix(client, ns):
    rev = client.put(ns + "a", b"\x00\xffbin")
    kv = client.get(ns + "a")
    assert kv.value == b"\x00\xffbin" and kv.mod_revision == rev and kv.version == 1
    client.put(ns + "b", "2")
    assert [k.key for k in client.get_prefix(ns)] == [(ns + "a").encode(), (ns + "b").encode()]
    assert client.count_prefix(ns) == 2
    assert [kv and kv.value for kv in client.get_many([ns + "b", ns + "zz"])] == [b"2", None]
    # More keys than etcd takes in one transaction (--max-txn-ops, 128): read in batches, in order.
    many = [ns + "b" if i % 100 == 7 else f"{ns}none{i}" for i in range(300)]
    assert [i for i, kv in enumerate(client.get_many(many)) if kv is not None] == [7, 107, 207]
    assert client.delete(ns + "a") and not client.delete(ns + "a")
    assert client.get(ns + "a") is None
    assert client.delete_prefix(ns) == 1 and client.get_prefix(ns) == []


def test_compare_and_swap_on_mod_revision(client, ns):
    k = ns + "cas"
    first = client.compare_and_swap(k, "v1", mod_revision=None)
    assert first.succeeded and first.kv.value == b"v1"
    # Create-only fails once the key exists, and hands back the winner.
    again = client.compare_and_swap(k, "other", mod_revision=None)
    assert not again.succeeded and again.kv == first.kv
    second = client.compare_and_swap(k, "v2", mod_revision=first.kv.mod_revision)
    assert second.succeeded and second.kv.value == b"v2"
    assert second.kv.mod_revision > first.kv.mod_revision
    # A stale revision loses and sees the current value, read in the same txn.
    stale = client.compare_and_swap(k, "v3", mod_revision=first.kv.mod_revision)
    assert not stale.succeeded and stale.kv == second.kv
    assert client.get(k).value == b"v2"
    # Absent key with a revision: fails, nothing to hand back.
    gone = client.compare_and_swap(ns + "absent", "x", mod_revision=12345)
    assert not gone.succeeded and gone.kv is None and client.get(ns + "absent") is None
    # Compare on value.
    assert not client.compare_value_and_swap(k, "nope", "v4").succeeded
    assert client.compare_value_and_swap(k, "v2", "v4").kv.value == b"v4"


def test_put_and_get_prefix_is_one_write_then_the_whole_prefix(client, ns):
    client.put(ns + "h/a", "1")
    for step in ("0007", "0012", "0009"):
        client.put(ns + "c/" + step, step)
    got, (newest, none) = client.put_and_get_prefix(ns + "h/b", "2", ns + "h/", newest_under=(ns + "c/", ns + "z/"))
    assert [(kv.key, kv.value) for kv in got] == [((ns + "h/a").encode(), b"1"), ((ns + "h/b").encode(), b"2")]
    assert newest is not None and newest.key == (ns + "c/0012").encode() and none is None
    assert client.put_and_get_prefix(ns + "h/c", "3", ns + "x/") == ([], [])


def test_create_all_is_all_or_nothing(client, ns):
    assert client.create_all({ns + "c/x": "1", ns + "c/y": "1"})
    # y exists: nothing is written, not even z.
    assert not client.create_all({ns + "c/y": "2", ns + "c/z": "2"})
    assert client.get(ns + "c/y").value == b"1" and client.get(ns + "c/z") is None


def test_cas_counter_under_contention(etcd, ns):
    """6 threads x 8 CAS increments: no lost update."""
    k = ns + "counter"

    def worker():
        with etcd.client() as c:
            for _ in range(8):
                kv = c.get(k)
                while True:
                    n = int(kv.value) + 1 if kv else 1
                    res = c.compare_and_swap(k, str(n), mod_revision=kv.mod_revision if kv else None)
                    if res.succeeded:
                        break
                    kv = res.kv

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with etcd.client() as c:
        assert int(c.get(k).value) == 48


def test_lease_expiry_removes_keys_and_keep_alive_holds_them(client, ns):
    ttl = timedelta(seconds=1)
    bare = client.lease(ttl, keep_alive=False)
    kept = client.lease(ttl)  # refreshed by its thread every ttl/3
    granted = time.monotonic()
    client.put(ns + "bare", "x", lease=bare)
    client.put(ns + "kept", "y", lease=kept.id)
    assert client.get(ns + "bare").lease == bare.id
    assert _wait_until(lambda: client.get(ns + "bare") is None, timedelta(seconds=15))
    with pytest.raises(EtcdLeaseExpired):
        bare.refresh()
    assert bare.expired
    with pytest.raises(EtcdLeaseExpired, match="grant a new one"):
        client.put(ns + "late", "z", lease=bare)
    # Make sure the kept lease has outlived its TTL at least twice over.
    time.sleep(max(0.0, 2 * ttl.total_seconds() - (time.monotonic() - granted)))
    assert client.get(ns + "kept").value == b"y" and not kept.expired
    kept.revoke()
    assert client.get(ns + "kept") is None


def test_lease_expiry_callback(client, ns):
    fired = threading.Event()
    lease = client.lease(timedelta(seconds=1), on_expired=lambda _l: fired.set())
    # Revoke behind the keep-alive thread's back: it must notice and report.
    client._post("/kv/lease/revoke", {"ID": lease.id}, "test revoke")
    assert fired.wait(10)
    assert lease.expired


@pytest.mark.timeout(30)
def test_unreachable_endpoint_fails_fast_with_typed_error():
    port = free_port()  # nothing listens here
    with EtcdClient(f"127.0.0.1:{port}", retry_timeout=timedelta(seconds=1)) as c:
        with pytest.raises(EtcdUnavailable) as info:
            c.check(timedelta(milliseconds=500))
        msg = str(info.value)
        assert f"127.0.0.1:{port}" in msg and "etcdctl" in msg and "endpoint health" in msg
        assert isinstance(info.value, ConnectionError)
        with pytest.raises(EtcdUnavailable):
            c.get("k")  # ordinary calls are bounded by retry_timeout


def test_failover_to_second_endpoint(etcd, ns):
    dead = f"127.0.0.1:{free_port()}"
    with EtcdClient([dead, etcd.endpoint], retry_timeout=timedelta(seconds=10)) as c:
        c.put(ns + "f", "ok")
        assert c.get(ns + "f").value == b"ok"


def test_config_errors_are_typed():
    with pytest.raises(EtcdError, match="certificate and its key"):
        EtcdClient("127.0.0.1:1", cert="/x.pem")
    with pytest.raises(EtcdError, match="username and a password"):
        EtcdClient("127.0.0.1:1", username="u")


def test_a_user_without_the_permission_is_refused_with_the_fix_after_one_login_again():
    """"permission denied" is checked with one fresh login (a refusal of a token the server
    no longer maps as it did), and a user who really lacks the permission is then refused with
    what to grant, not retried for ever."""
    import base64

    from resilient.etcd import EtcdAuthError
    from resilient_chaos.etcd_testing import embedded_etcd, enable_auth

    with embedded_etcd() as server:
        with server.client() as admin:
            admin._post("/auth/user/add", {"name": "limited", "password": "pw"}, "user add")
            admin._post("/auth/role/add", {"name": "mine"}, "role add")
            prefix = {"key": base64.b64encode(b"/mine/").decode(), "range_end": base64.b64encode(b"/mine0").decode()}
            admin._post("/auth/role/grant", {"name": "mine", "perm": {"permType": "READWRITE", **prefix}}, "grant")
            admin._post("/auth/user/grant", {"user": "limited", "role": "mine"}, "user grant")
            enable_auth(admin, "rootpw")
        with EtcdClient([f"http://{server.endpoint}"], username="limited", password="pw",
                        retry_timeout=timedelta(seconds=5)) as c:
            logins = []
            real = c._set_token
            c._set_token = lambda token: (logins.append(token), real(token))[1]
            c.put("/mine/a", b"1")
            assert c.get("/mine/a").value == b"1"
            logins.clear()
            with pytest.raises(EtcdAuthError, match="grant the user a role"):
                c.put("/theirs/a", b"1")
            assert len([t for t in logins if t]) == 1, logins   # one login again, then the refusal


def test_threads_sharing_a_client_are_not_refused_while_one_of_them_logs_in_again(tmp_path):
    """The agent's threads share one client. After its embedded etcd restarted (every token
    forgotten), one thread logs in again while the others wait for that login: none sends a
    request without a token meanwhile (over the embedded etcd's client-certificate TLS, etcd
    takes one as from the certificate's empty name and refuses it "permission denied")."""
    import os

    from resilient.etcd import EmbeddedEtcd
    from resilient.etcd.server import embedded_tls
    from resilient.secret import JobSecret

    secret = JobSecret(os.urandom(32))
    with EmbeddedEtcd(root_password=secret.etcd_password, tls=embedded_tls(secret, tmp_path, server=True)) as server:
        with server.client(retry_timeout=timedelta(seconds=30)) as c:
            c.put("/t/0", b"before")
            time.sleep(1)   # etcd's backend commits its applied index (the login's too) within 0.1 s:
            # killed sooner, it applies the login again from its log at the restart, and the token lives on
            logins = []
            real = c._set_token
            c._set_token = lambda token: (logins.append(token), real(token))[1]
            server.kill()
            server.start()
            threads, errors = 8, []
            start = threading.Barrier(threads)

            def work(i: int) -> None:
                start.wait()
                try:
                    for n in range(5):
                        c.put(f"/t/{i}", str(n).encode())
                        assert c.get(f"/t/{i}").value == str(n).encode()
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            assert not errors, errors
            assert len(logins) == 1, logins   # one login for all eight threads
