"""resilient.etcd.watch against a real etcd: a change wakes the waiter, nothing else does,
and a watch that cannot be had falls back to polling instead of failing anyone."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

from resilient.etcd.client import EtcdClient
from resilient_chaos.etcd_testing import embedded_etcd, enable_auth, unique_run_id
from resilient.etcd.watch import Watch


def _put_later(client, key, seconds=0.3):
    t = threading.Timer(seconds, lambda: client.put(key, "v"))
    t.start()
    return t


def test_a_change_wakes_the_waiter_and_nothing_else_does(etcd):
    base = f"/{unique_run_id('watch')}"
    with etcd.client() as c:
        with Watch(c, f"{base}/k") as w:
            assert not w.broken
            assert w.wait(timedelta(seconds=0.2)) is False              # nothing yet
            c.put(f"{base}/other", "x")                                  # not the watched key
            assert w.wait(timedelta(seconds=0.2)) is False
            t = _put_later(c, f"{base}/k")
            assert w.wait(timedelta(seconds=30)) is True                 # came before 30 s
            t.join()
        # a prefix: any key under it, deletions too; a change made before the wait is not lost
        c.put(f"{base}/p/a", "1")
        with Watch(c, f"{base}/p/", prefix=True) as w:
            c.delete(f"{base}/p/a")
            assert w.wait(timedelta(seconds=30)) is True
            assert w.wait(timedelta(seconds=0.2)) is False
            c.put(f"{base}/q", "outside")
            assert w.wait(timedelta(seconds=0.2)) is False


def test_a_watch_that_cannot_be_had_polls_instead():
    """Nothing listens: the watch is broken, and its waits say "read now" after the fallback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with EtcdClient(f"127.0.0.1:{port}", request_timeout=timedelta(seconds=0.5)) as c:
        w = Watch(c, "/x", fallback=timedelta(seconds=0.05))
        assert w.broken
        assert w.wait(timedelta(seconds=30)) is True
        w.close()


def test_a_watch_on_an_etcd_with_authentication_and_one_that_restarts():
    """The stream carries the client's token; an etcd that goes away ends the watch, whose
    waits then fall back to polling (the waiter reads, and reads again)."""
    with embedded_etcd() as server, server.client() as admin:
        enable_auth(admin, "rootpw")
        with EtcdClient(server.endpoint, username="root", password="rootpw") as c:
            with Watch(c, "/auth/k", fallback=timedelta(seconds=0.05)) as w:
                assert not w.broken
                assert w.wait(timedelta(seconds=0.2)) is False   # a refused token would cancel it: True
                t = _put_later(c, "/auth/k")
                assert w.wait(timedelta(seconds=30)) is True
                t.join()
                server.stop()
                assert w.wait(timedelta(seconds=30)) is True and w.broken   # not the 30 s timeout's False


def test_a_watch_from_a_revision_reports_what_changed_since_that_read(etcd):
    """``after`` = the revision of the waiter's read: a change made between that read and the
    watch's opening wakes it (no read in between needed); a compacted one does too."""
    base = f"/{unique_run_id('watch-rev')}"
    with etcd.client() as c:
        read_at = c.put(f"{base}/k", "1")
        c.put(f"{base}/k", "2")                        # after the read, before the watch
        with Watch(c, f"{base}/k", after=read_at) as w:
            assert w.wait(timedelta(seconds=30)) is True
            assert w.wait(timedelta(seconds=0.2)) is False
        with Watch(c, f"{base}/k", after=c.revision()) as w:
            assert w.wait(timedelta(seconds=0.2)) is False   # nothing since
        c.compact(c.revision())
        with Watch(c, f"{base}/k", after=read_at) as w:   # that history is gone: read
            assert w.wait(timedelta(seconds=30)) is True


def test_a_canceled_watch_says_read_once_then_polls(etcd):
    """etcd cancels a watch from a compacted revision: the waiter is told to read, and the
    watch is broken from then on (a canceled stream says nothing more), so it polls."""
    base = f"/{unique_run_id('watch-cancel')}"
    with etcd.client() as c:
        first = c.put(f"{base}/k", "1")
        c.put(f"{base}/k", "2")
        c.compact(c.revision())
        with Watch(c, f"{base}/k", after=first - 1, fallback=timedelta(seconds=0.05)) as w:
            assert w.wait(timedelta(seconds=30)) is True and w.broken
            assert w.wait(timedelta(seconds=30)) is True   # polling: read every fallback
