"""The etcd gateway transport: kept-alive connections, dropped ones replaced, typed failures."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

from resilient.etcd.transport import Gateway, Refused, ServerBusy, Unreachable


class OneShotServer:
    """Answers each connection's first request with ``status`` and a JSON body, then closes
    the connection *without* saying so (no ``Connection: close``): an idle keep-alive
    connection the server dropped, as after an etcd restart or an idle timeout."""

    def __init__(self, status: int = 200, body: bytes = b'{"ok": true}'):
        self.status, self.body = status, body
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                while len(rest) < length:
                    rest += conn.recv(65536)
                reason = {200: b"OK", 503: b"Service Unavailable", 400: b"Bad Request"}[self.status]
                conn.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (self.status, reason, len(self.body), self.body))

    def close(self) -> None:
        self.sock.close()


def test_a_connection_the_server_dropped_is_replaced_not_failed():
    srv = OneShotServer()
    try:
        gw = Gateway("http", "127.0.0.1", srv.port, timedelta(seconds=5))
        assert gw.post("/kv/range", {"key": "eA=="}) == {"ok": True}
        time.sleep(0.2)  # the server has closed its end by now
        assert gw.post("/kv/range", {"key": "eA=="}) == {"ok": True}
        assert srv.connections == 2
        gw.close()
    finally:
        srv.close()


@pytest.mark.parametrize("status,kind", [(503, ServerBusy), (400, Refused)])
def test_http_errors_are_typed(status, kind):
    srv = OneShotServer(status, b'{"error": "etcdserver: no leader"}')
    try:
        with pytest.raises(kind, match="no leader"):
            Gateway("http", "127.0.0.1", srv.port, timedelta(seconds=5)).post("/kv/put", {})
    finally:
        srv.close()


def test_nobody_listening_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(Unreachable, match="ConnectionRefused"):
            Gateway("http", "127.0.0.1", port, timedelta(seconds=5)).post("/kv/range", {})


def test_connections_of_ended_threads_are_closed():
    """One connection per thread; a thread that ended does not keep its socket open."""
    srv = OneShotServer()
    try:
        gw = Gateway("http", "127.0.0.1", srv.port, timedelta(seconds=5))
        for _ in range(3):
            t = threading.Thread(target=gw.post, args=("/kv/range", {}))
            t.start()
            t.join()
        gw.post("/kv/range", {})
        assert len(gw._all) == 1  # only this thread's
        gw.close()
    finally:
        srv.close()
