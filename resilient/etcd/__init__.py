"""etcd v3 for resilient: a typed client that rides through outages, and an embedded server.

``EtcdClient`` (client.py) is what the rendezvous backend, the agent's
liveness lease and the snapshot commit records use; ``EmbeddedEtcd``
(server.py) is the single-machine default and what the tests run against.
"""

from resilient.etcd.api import (
    EtcdAuthDisabled,
    EtcdAuthError,
    EtcdError,
    EtcdFull,
    EtcdLeaseExpired,
    EtcdNotFound,
    EtcdUnavailable,
    KeyValue,
)
from resilient.etcd.client import CasResult, EtcdClient, Lease, LivenessLease, parse_endpoints
from resilient.etcd.server import EmbeddedEtcd, find_etcd, free_port

__all__ = [
    "CasResult",
    "EmbeddedEtcd",
    "EtcdAuthDisabled",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdFull",
    "EtcdLeaseExpired",
    "EtcdNotFound",
    "EtcdUnavailable",
    "KeyValue",
    "Lease",
    "LivenessLease",
    "find_etcd",
    "free_port",
    "parse_endpoints",
]
