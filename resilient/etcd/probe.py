"""Ask etcd servers what they are and what time it is: ``GET /version`` and its ``Date``.

Why not :class:`~resilient.etcd.client.EtcdClient`: ``/version`` sits outside the v3
gateway, needs no credentials, and is what tells a too-old server (no ``/v3/``
gateway) from an unreachable one. The preflight (:mod:`resilient.preflight`) uses
it before a job starts: each endpoint's version, and this node's clock against
etcd's, the one clock every node of a job talks to.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from email.utils import parsedate_to_datetime
from typing import Any, Callable

from resilient.etcd.endpoints import parse_endpoints
from resilient.etcd.transport import tls_context

__all__ = ["EtcdAnswer", "MIN_VERSION", "parse_version", "version_issue", "probe_endpoints"]

MIN_VERSION = (3, 4, 0)  # the v3 JSON gateway at /v3/ (resilient.etcd.client)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(3, 5, 1)`` from ``"3.5.1"`` or ``"etcd Version: 3.5.1"``; None when there is none."""
    m = _VERSION.search(text)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def version_issue(version: tuple[int, int, int]) -> tuple[str, str] | None:
    """None for a good server version, else ``("unsupported" | "crash-bug", why)``."""
    if version < MIN_VERSION:
        return "unsupported", "older than 3.4: no v3 JSON gateway at /v3/, which resilient talks to"
    # Data-inconsistency bugs after a crash: 3.5.0-3.5.2 (etcd-io/etcd#13766), 3.4.21 and 3.5.5;
    # etcd's maintainers advise 3.4.22+ or 3.5.6+ in production.
    if version[:2] == (3, 4) and version < (3, 4, 22) or version[:2] == (3, 5) and version < (3, 5, 6):
        return "crash-bug", ("has known data-inconsistency bugs after crashes (fixed in 3.4.22 and 3.5.6): "
                             "upgrade the cluster")
    return None


@dataclass(frozen=True)
class EtcdAnswer:
    """One endpoint's answer: its URL, ``etcdserver`` version, and, when timed, the bounds
    of (etcd's clock − ours) in seconds."""

    url: str
    version: str
    offset: tuple[float, float] | None


class _Probe:
    """``GET /version`` on one endpoint over one kept-alive connection."""

    def __init__(self, scheme: str, host: str, port: int, context: Any, timeout: timedelta):
        if scheme == "https":
            self.conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout.total_seconds(), context=context)
        else:
            self.conn = http.client.HTTPConnection(host, port, timeout=timeout.total_seconds())
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{scheme}://{shown}:{port}"

    def get(self) -> tuple[dict, float | None]:
        """(the JSON answer, the ``Date`` header as a timestamp or None)."""
        self.conn.request("GET", "/version")
        resp = self.conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status} {resp.reason}")
        date = resp.getheader("Date")
        return json.loads(body), (parsedate_to_datetime(date).timestamp() if date else None)

    def clock_offset(self, clock: Callable[[], float], budget: timedelta) -> tuple[float, float] | None:
        """Bounds of (etcd's clock − ours), from the moment etcd's ``Date`` (whole seconds)
        ticks: etcd's clock read exactly ``date`` at a local time between the start of the
        request before the tick and the end of the one that saw it. Precise to about two
        round trips; polls for up to ``budget`` (a second suffices)."""
        deadline = time.monotonic() + budget.total_seconds()
        before: tuple[float, float] | None = None
        while time.monotonic() < deadline:
            t0 = clock()
            _, date = self.get()
            t1 = clock()
            if date is None:
                return None
            if before is not None and date > before[0]:
                return date - t1, date - before[1]
            before = (date, t0)
        return None

    def close(self) -> None:
        self.conn.close()


def probe_endpoints(endpoints: str, conf: dict[str, str], *, clock: Callable[[], float] = time.time,
                    timeout: timedelta = timedelta(seconds=3),
                    clock_budget: timedelta = timedelta(seconds=1.5)) -> tuple[list[EtcdAnswer], list[str]]:
    """(answers of the endpoints that replied, one error line per endpoint that did not).

    ``conf``: the TLS keys of ``--rdzv-conf`` (protocol, ca_cert/cacert, ssl_cert/cert,
    ssl_cert_key/key). Only the first answering endpoint is timed for its clock
    (``clock_budget`` zero: none)."""
    ca = conf.get("ca_cert") or conf.get("cacert")
    cert = conf.get("ssl_cert") or conf.get("cert")
    key = conf.get("ssl_cert_key") or conf.get("key")
    default = (conf.get("protocol") or ("https" if ca or cert else "http")).lower()
    answers: list[EtcdAnswer] = []
    errors: list[str] = []
    for scheme, host, port in parse_endpoints(endpoints):
        scheme = scheme or default
        probe = _Probe(scheme, host, port, tls_context(ca, cert, key) if scheme == "https" else None, timeout)
        try:
            doc, _ = probe.get()
            timed = not answers and clock_budget > timedelta(0)
            offset = probe.clock_offset(clock, clock_budget) if timed else None
            answers.append(EtcdAnswer(probe.url, str(doc.get("etcdserver", "?")), offset))
        except (OSError, http.client.HTTPException, ValueError) as e:
            errors.append(f"{probe.url}: {type(e).__name__}: {e}")
        finally:
            probe.close()
    return answers, errors
