"""HTTP to one etcd endpoint's v3 JSON gateway: keep-alive connections, typed failures.

Why not ``requests`` (and ``etcd3gw`` over it): the snapshot replicator makes
one or two etcd requests per training step on every node, and agents renew
leases and heartbeats all run long. Measured here against a local etcd
(``python bench/etcd_client_cost.py``, 600 requests of each kind): through
``requests`` the client spent 0.9-1.2 ms of CPU per request, through this
0.2-0.3 ms (a bare ``http.client`` connection: 0.15-0.2), etcd's own share
unchanged. On a host whose cores train, that client CPU is taken from the step.

One connection per thread (the client is shared by the agent's threads; an
HTTP/1.1 connection carries one request at a time). A connection the server
closed while idle (etcd restarted, an idle timeout) is noticed before reuse
and replaced, as ``urllib3`` does, so an idle client does not fail its next
request. Failures are typed for :class:`~resilient.etcd.client.EtcdClient`'s
retry loop: :class:`Unreachable` and :class:`ServerBusy` are worth retrying
(down, restarting, no leader yet), :class:`Refused` is a real answer.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import threading
from datetime import timedelta
from typing import Any


class TransportError(Exception):
    """A failed request; ``detail_text`` is the server's body or the socket error."""

    def __init__(self, detail_text: str):
        super().__init__(detail_text)
        self.detail_text = detail_text


class Unreachable(TransportError):
    """No answer: refused, reset, timed out, or TLS failed."""


class ServerBusy(TransportError):
    """HTTP 5xx or 408: etcd is up but cannot serve now (no leader, restarting, timed out)."""


class Refused(TransportError):
    """Any other non-200 answer (bad request, auth, lease not found...)."""


def tls_context(ca_cert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """Verify the server against ``ca_cert`` (else the system's CAs); present ``cert``/``key``."""
    ctx = ssl.create_default_context(cafile=ca_cert) if ca_cert else ssl.create_default_context()
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


def _dropped(sock: socket.socket) -> bool:
    """Did the server close this idle connection? (Readable with nothing pending = EOF.)"""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class Gateway:
    """``post(path, body)`` to ``SCHEME://HOST:PORT/v3/PATH``; thread-safe."""

    def __init__(self, scheme: str, host: str, port: int, timeout: timedelta,
                 context: ssl.SSLContext | None = None, api_path: str = "/v3/"):
        self.scheme, self.host, self.port = scheme, host, port
        self.timeout = timeout.total_seconds()
        self.context = context if scheme == "https" else None
        self.api_path = api_path
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"{scheme}://{shown}:{port}"
        self.headers = {"Content-Type": "application/json"}
        self._local = threading.local()
        self._all: list[tuple[threading.Thread, http.client.HTTPConnection]] = []
        self._lock = threading.Lock()

    def set_token(self, token: str | None) -> None:
        """The auth token sent with every request (None: none)."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        self.headers = headers  # replaced whole: other threads see the old or the new dict

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            conn.close()  # reopened by the next request
        if conn is None:
            if self.scheme == "https":
                conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context)
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                # Threads that used the client and ended leave their connection: close those.
                for thread, old in self._all:
                    if not thread.is_alive():
                        old.close()
                self._all = [(t, c) for t, c in self._all if t.is_alive()]
                self._all.append((threading.current_thread(), conn))
        return conn

    def _forget(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._lock:
                self._all = [(t, c) for t, c in self._all if c is not conn]

    def post(self, path: str, body: dict[str, Any], with_token: bool = True) -> dict[str, Any]:
        """``with_token=False``: without the auth token (a login: the token it replaces may be stale)."""
        conn = self._connection()
        headers = self.headers if with_token else {"Content-Type": "application/json"}
        try:
            conn.request("POST", self.api_path + path.lstrip("/"), json.dumps(body), headers)
            resp = conn.getresponse()
            status, reason, data = resp.status, resp.reason, resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, TLS
            self._forget()
            raise Unreachable(f"{self.base_url}: {type(e).__name__}: {e}") from None
        if resp.will_close:
            self._forget()
        if status == 200:
            try:
                return json.loads(data)
            except ValueError:
                raise ServerBusy(f"{self.base_url}: an answer that is not JSON: {data[:200]!r}") from None
        text = data.decode(errors="replace") or reason
        raise (ServerBusy if status >= 500 or status == 408 else Refused)(text)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for _, c in conns:
            c.close()


def open_stream(gw: Gateway, path: str, body: dict[str, Any]) -> tuple[socket.socket, bytes]:
    """POST ``body`` to ``path`` on a connection of its own whose answer streams (etcd's
    ``/v3/watch``: a chunked response of one JSON message per line, open until closed);
    returns the socket and what was read past the answer's headers. Not the thread's
    keep-alive connection: the stream holds its connection for as long as it is open."""
    sock: socket.socket | None = None
    try:
        sock = socket.create_connection((gw.host, gw.port), timeout=gw.timeout)
        if gw.context is not None:
            sock = gw.context.wrap_socket(sock, server_hostname=gw.host)
        head = "".join(f"{k}: {v}\r\n" for k, v in gw.headers.items())
        data = json.dumps(body).encode()
        host = gw.base_url.split("://", 1)[1]   # host:port, an IPv6 host in brackets
        sock.sendall(f"POST {gw.api_path}{path.lstrip('/')} HTTP/1.1\r\nHost: {host}\r\n"
                     f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while b"\r\n\r\n" not in got:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError("closed before the answer's headers")
            got += more
    except (OSError, ssl.SSLError) as e:
        if sock is not None:
            sock.close()
        raise Unreachable(f"{gw.base_url}: {type(e).__name__}: {e}") from None
    headers, rest = got.split(b"\r\n\r\n", 1)
    status = headers.split(b"\r\n", 1)[0].split()
    code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
    if code != 200:
        sock.close()
        text = f"{gw.base_url}: HTTP {code or headers[:80]!r} to a streamed {path}"
        raise (ServerBusy if code >= 500 or code == 408 else Refused)(text)
    return sock, rest
