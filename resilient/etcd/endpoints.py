"""etcd endpoint strings: ``host:port[,host:port...]``, URLs, bracketed IPv6."""

from __future__ import annotations

from typing import Sequence
from urllib.parse import urlsplit

from resilient.etcd.api import EtcdError

DEFAULT_PORT = 2379


def parse_endpoints(
    endpoints: str | Sequence[str], default_port: int = DEFAULT_PORT
) -> list[tuple[str, str, int]]:
    """Parse ``"host:port,host2:port2"`` (or a list) into (scheme, host, port).

    Accepts what torch's etcd backend accepts (``host``, ``host:port``) plus
    ``http://`` / ``https://`` URLs and bracketed IPv6 (``[::1]:2379``).
    """
    if isinstance(endpoints, str):
        items = [e.strip() for e in endpoints.split(",")]
    else:
        items = [str(e).strip() for e in endpoints]
    items = [e for e in items if e]
    if not items:
        raise EtcdError(
            "no etcd endpoint given; pass HOST:PORT (comma-separated for a cluster), "
            "e.g. --rdzv-endpoint 10.0.0.5:2379"
        )
    out = []
    for item in items:
        scheme = ""
        if "://" in item:
            scheme = item.split("://", 1)[0].lower()
            if scheme not in ("http", "https"):
                raise EtcdError(f"etcd endpoint {item!r}: scheme must be http or https")
        parts = urlsplit(item if scheme else "//" + item)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise EtcdError(f"etcd endpoint {item!r} is not HOST:PORT ({exc})") from None
        if not host:
            raise EtcdError(f"etcd endpoint {item!r} has no host; expected HOST:PORT")
        out.append((scheme, host, port or default_port))
    return out
