"""A TCP proxy that degrades a link: delay, bandwidth cap, connection resets.

This kernel has no ``tc netem``, so link degradation is done in user space:
the client talks to the proxy (loopback, port 0 = a free port), the proxy to
the real server. Each direction of each connection has a reader that stamps
every chunk with its arrival time and a writer that sends it no earlier than
``arrival + delay`` and no faster than the bandwidth cap, so a delay adds
latency without throttling throughput (as a real long link does).

The proxy runs its own asyncio loop in a daemon thread; the control methods
are thread-safe and take effect on open connections immediately.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

from .injectors import InjectionFailed, Injector

_CHUNK = 64 * 1024
# How long a control call may wait for the proxy's event loop.
LOOP_TIMEOUT = timedelta(seconds=10)


class _Conn:
    """One proxied connection: two sockets' streams and four tasks."""

    def __init__(self, proxy: "TcpProxy", cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.proxy, self.cr, self.cw = proxy, cr, cw
        self.uw: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        try:
            ur, self.uw = await asyncio.open_connection(*self.proxy.upstream)
        except OSError:
            self.abort()
            return
        self.tasks = [
            asyncio.ensure_future(self._pipe(self.cr, self.uw)),
            asyncio.ensure_future(self._pipe(ur, self.cw)),
        ]
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def reader() -> None:
            try:
                while data := await r.read(_CHUNK):
                    self.proxy.bytes_in += len(data)
                    queue.put_nowait((time.monotonic(), data))
            except (OSError, asyncio.IncompleteReadError):
                pass
            queue.put_nowait((time.monotonic(), b""))

        task = asyncio.ensure_future(reader())
        next_free = 0.0
        try:
            while True:
                arrived, data = await queue.get()
                if not data:
                    if w.can_write_eof():
                        w.write_eof()
                    break
                delay = self.proxy._delay
                bw = self.proxy._bandwidth
                piece = max(1, bw // 20) if bw else len(data)
                for i in range(0, len(data), piece):
                    part = data[i:i + piece]
                    start = max(time.monotonic(), arrived + delay, next_free)
                    wait = start - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self.proxy.bytes_out += len(part)
                    w.write(part)
                    await w.drain()
                    next_free = start + (len(part) / bw if bw else 0.0)
        except OSError:
            pass
        finally:
            task.cancel()

    def abort(self) -> None:
        """Close both sides with RST (SO_LINGER 0), as a broken link does."""
        for w in (self.cw, self.uw):
            if w is None:
                continue
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            w.transport.abort()
        for t in self.tasks:
            t.cancel()

    def close(self) -> None:
        for w in (self.cw, self.uw):
            if w is not None:
                w.close()
        self.proxy._conns.discard(self)


class TcpProxy:
    """Forward ``host:port`` (port 0: a free one) to ``upstream``.

    ``set_delay`` / ``set_bandwidth`` change the link for open and new
    connections; ``reset_connections`` RSTs every open connection;
    ``refuse_new`` RSTs connections as they arrive. ``close()`` stops it.
    """

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream
        self._bind = (host, port)
        self._delay = 0.0
        self._bandwidth = 0
        self._refuse = False
        self._conns: set[_Conn] = set()
        self.bytes_in = 0
        self.bytes_out = 0
        self.connections = 0
        self.resets = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy", daemon=True)
        self.address: tuple[str, int] = ("", 0)

    def start(self) -> "TcpProxy":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._accept, *self._bind), self._loop)
        self._server = fut.result(LOOP_TIMEOUT.total_seconds())
        self.address = self._server.sockets[0].getsockname()[:2]
        return self

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = _Conn(self, r, w)
        if self._refuse:
            self.resets += 1
            conn.abort()
            return
        self._conns.add(conn)
        await conn.run()

    def _call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(LOOP_TIMEOUT.total_seconds())

    @property
    def delay(self) -> timedelta:
        return timedelta(seconds=self._delay)

    @property
    def bandwidth(self) -> int:
        """Current cap in bytes/s per direction; 0 = none."""
        return self._bandwidth

    def set_delay(self, delay: timedelta) -> None:
        """One-way delay added to each chunk, in each direction."""
        self._delay = max(0.0, delay.total_seconds())

    def set_bandwidth(self, bytes_per_second: int | None) -> None:
        """Cap each direction of each connection; None or 0 lifts the cap."""
        self._bandwidth = int(bytes_per_second or 0)

    def refuse_new(self, refuse: bool) -> None:
        self._refuse = refuse

    def reset_connections(self) -> int:
        """RST every open connection; returns how many were reset."""
        def do() -> int:
            conns = list(self._conns)
            for c in conns:
                c.abort()
                self._conns.discard(c)
            return len(conns)
        n = self._call(do)
        self.resets += n
        return n

    def open_connections(self) -> int:
        return self._call(lambda: len(self._conns))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for c in list(self._conns):
                c.abort()
            self._conns.clear()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(LOOP_TIMEOUT.total_seconds())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(LOOP_TIMEOUT.total_seconds())
        self._loop.close()

    def __enter__(self) -> "TcpProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ProxyFault(Injector):
    """delay / bandwidth / reset on a :class:`TcpProxy`, lifted on clear.

    The observed effect is the proxy's state (and, for reset, the number of
    connections actually torn down); the tests measure it on the wire.
    """

    def __init__(self, proxy: TcpProxy, kind: str, *, delay: timedelta = timedelta(0), bytes_per_second: int = 0, refuse_new: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        if kind not in ("delay", "bandwidth", "reset"):
            raise ValueError(f"ProxyFault kind must be delay, bandwidth or reset, got {kind!r}")
        self.kind, self.proxy = kind, proxy
        self.delay, self.bytes_per_second, self.refuse = delay, bytes_per_second, refuse_new

    def _inject(self) -> str:
        if not self.proxy._thread.is_alive():
            raise InjectionFailed(f"proxy {self.proxy.address} is not running")
        if self.kind == "delay":
            self.proxy.set_delay(self.delay)
            return f"delay {self.delay.total_seconds() * 1000:.0f} ms each way on {self.proxy.address}"
        if self.kind == "bandwidth":
            self.proxy.set_bandwidth(self.bytes_per_second)
            return f"bandwidth capped at {self.bytes_per_second} B/s on {self.proxy.address}"
        self.proxy.refuse_new(self.refuse)
        n = self.proxy.reset_connections()
        return f"reset {n} open connection(s)" + ("; refusing new ones" if self.refuse else "")

    def _clear(self) -> None:
        if self.kind == "delay":
            self.proxy.set_delay(timedelta(0))
        elif self.kind == "bandwidth":
            self.proxy.set_bandwidth(None)
        else:
            self.proxy.refuse_new(False)
