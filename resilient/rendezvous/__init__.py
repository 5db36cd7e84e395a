"""Rendezvous for resilient: an etcd v3 backend for torch's DynamicRendezvousHandler.

``register()`` makes ``--rdzv-backend etcd3`` available in-process; plain
``torchrun`` finds it through the ``torchrun.handlers`` entry point.
"""

from resilient.rendezvous.api import (
    RendezvousConfigError,
    RendezvousError,
    RendezvousStateCorrupt,
    RendezvousUnavailable,
)
from resilient.rendezvous.etcd3_backend import Etcd3RendezvousBackend, Etcd3Store
from resilient.rendezvous.registry import (
    BACKEND_NAME,
    client_from_params,
    create_backend,
    create_etcd3_handler,
    register,
)

__all__ = [
    "BACKEND_NAME",
    "Etcd3RendezvousBackend",
    "Etcd3Store",
    "RendezvousConfigError",
    "RendezvousError",
    "RendezvousStateCorrupt",
    "RendezvousUnavailable",
    "client_from_params",
    "create_backend",
    "create_etcd3_handler",
    "register",
]
