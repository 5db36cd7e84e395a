"""Sleep until etcd changes: a watch on one key or prefix, through the gateway's ``/v3/watch``.

Why: an agent waiting for something in etcd (a round's membership, a key its
peers write) used to poll at a fixed rate, so N waiting agents cost etcd N
reads per interval whether anything changed or not. At 512 simulated nodes on
one host those polls were most of what etcd spent its CPU on during a
re-form (bench/scale.py). A watch is one open stream per waiter on which etcd
says when something changed; the waiter reads then, and only then.

A watch only says *when* to read, never *what* is there: a waiter reads the
state itself after every wake and after every timeout, as it did when it
polled. So a watch that cannot be opened or breaks (an endpoint down, a
gateway that does not stream, a compacted revision) costs nothing but speed:
:meth:`Watch.wait` then sleeps ``fallback`` and says "read now", i.e. the old
polling. Nothing read from the stream is trusted: a line is only looked at for
whether it reports a change.

The stream (etcd's grpc-gateway): a chunked HTTP response of one JSON message
per line, ``{"result": {"created": true}}`` first, then one message per batch
of changes (``"events"``), or ``"canceled"`` when etcd ends it.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

from resilient.etcd.transport import open_stream

if TYPE_CHECKING:
    from resilient.etcd.client import EtcdClient

__all__ = ["Watch", "REFUSED_FOR"]

REFUSED_FOR = timedelta(seconds=60)   # a client whose watch failed polls this long before trying again
_refused: "weakref.WeakKeyDictionary[EtcdClient, float]" = weakref.WeakKeyDictionary()


class Watch:
    """Changes under ``key`` (every key starting with it when ``prefix``) after revision
    ``after``, or from the moment the watch was created: then open it *before* reading the
    state it guards (or read again after opening it), so that no change between the read
    and the wait is missed. A context manager; :meth:`close` it."""

    def __init__(self, client: "EtcdClient", key: bytes | str, *, prefix: bool = False,
                 after: int | None = None, fallback: timedelta = timedelta(seconds=0.5),
                 open_timeout: timedelta | None = None):
        """``after``: the revision of the caller's last read; changes since it are reported
        (no read needed between that read and the watch). A compacted ``after`` cancels the
        watch at once, which :meth:`wait` reports as a change: read. ``open_timeout``: the
        most the opening may take (the client's request timeout at most)."""
        from resilient.etcd.client import _b64, _range

        self.fallback = fallback.total_seconds()
        self._sock: socket.socket | None = None
        self._buf = b""
        self._changed_since_open = False   # a change came in with the "created" message
        request = {"create_request": {**(_range(key) if prefix else {"key": _b64(key)}),
                                      **({"start_revision": int(after) + 1} if after is not None else {})}}
        if _refused.get(client, 0.0) > time.monotonic():
            return   # this client's etcd would not stream a watch a moment ago: poll
        limit = min(client.request_timeout, open_timeout) if open_timeout is not None else client.request_timeout
        try:
            # the client's failover and authentication; one short try (a watch is an optimisation)
            self._sock, self._buf = client._call(
                f"watch {key!r}", lambda gw: open_stream(gw, "/watch", request),
                retry_timeout=max(limit, timedelta(0)))
            self._poller = select.poll()
            self._poller.register(self._sock, select.POLLIN)
            if not self._read_until(time.monotonic() + max(0.0, limit.total_seconds()), created=True):
                raise OSError("no 'created' answer")   # not a stream we understand
        except Exception:  # noqa: BLE001 - whatever failed (etcd down, refused, not a stream): poll
            self.close()
            # A proxy that buffers the stream would cost every waiter request_timeout: this
            # client polls for a while instead of trying again at every wait.
            _refused[client] = time.monotonic() + REFUSED_FOR.total_seconds()

    @property
    def broken(self) -> bool:
        """No stream: :meth:`wait` sleeps ``fallback`` and says "read now" (polling)."""
        return self._sock is None

    def wait(self, timeout: timedelta | float) -> bool:
        """Block until a change (True), or ``timeout`` passed with none (False). True also when
        the watch is broken, after ``fallback`` seconds (at most ``timeout``): read then."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if self._changed_since_open:   # a change (or a cancel) came with an earlier read
            self._changed_since_open = False
            return True
        if self._sock is None:
            time.sleep(max(0.0, min(seconds, self.fallback)))
            return True
        try:
            return self._read_until(time.monotonic() + max(0.0, seconds))
        except (OSError, ValueError):
            self.close()
            return True

    def _read_until(self, deadline: float, created: bool = False) -> bool:
        """Read the stream's lines until a change (or, ``created``, the creation) is reported,
        or ``deadline``. Chunk framing (sizes, CRLFs) arrives as lines that are not JSON."""
        assert self._sock is not None
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"{"):
                    continue   # a chunk's size or its closing CRLF
                try:
                    result = json.loads(line).get("result") or {}
                except ValueError:
                    return True   # a message split across chunks: something came; read
                if result.get("canceled"):
                    # etcd ended the watch (a compacted revision, a token it refused): read now,
                    # and poll from then on (a canceled stream says nothing more)
                    self._changed_since_open = True
                    self.close()
                    return True
                if result.get("events"):
                    if created:   # came together with the creation: say it at the first wait
                        self._changed_since_open = True
                    return True
                if created and result.get("created"):
                    return True
            pending = self._sock.pending() if isinstance(self._sock, ssl.SSLSocket) else 0
            if not pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if not self._poller.poll(left * 1000):   # poll(), not select(): fds past 1024
                    return False
            more = self._sock.recv(65536)
            if not more:   # etcd closed the stream (restart, shutdown)
                raise OSError("the watch stream was closed")
            self._buf += more

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
