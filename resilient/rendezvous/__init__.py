"""Rendezvous for resilient: an etcd v3 backend for torch's DynamicRendezvousHandler.

``register()`` makes ``--rdzv-backend etcd3`` available in-process; plain
``torchrun`` finds it through the ``torchrun.handlers`` entry point.
"""

# torch discovers out-of-tree handlers (our entry point) when its rendezvous package is
# first imported; importing it before our modules lets that discovery load them whole,
# instead of meeting this package half-initialized (an ImportError logged as a warning).
import torch.distributed.elastic.rendezvous  # noqa: F401  (first, see above)

from resilient.rendezvous.api import (
    RendezvousConfigError,
    RendezvousError,
    RendezvousRoundLost,
    RendezvousStateCorrupt,
    RendezvousUnavailable,
)
from resilient.rendezvous.etcd3_backend import Etcd3RendezvousBackend, Etcd3Store
from resilient.rendezvous.handler import ResilientRendezvousHandler
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
    "RendezvousRoundLost",
    "ResilientRendezvousHandler",
    "RendezvousStateCorrupt",
    "RendezvousUnavailable",
    "client_from_params",
    "create_backend",
    "create_etcd3_handler",
    "register",
]
