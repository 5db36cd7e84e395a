"""Typed rendezvous errors, bridged to torch.distributed.elastic's.

Each error derives from both :class:`resilient.errors.ResilientError` (so
resilient's callers catch one root) and the matching
``torch.distributed.elastic.rendezvous`` error (so torch's elastic agent and
``DynamicRendezvousHandler`` treat it exactly as they treat their own).
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError as _TorchConnectionError,
    RendezvousError as _TorchRendezvousError,
    RendezvousStateError as _TorchStateError,
)

from resilient.errors import ConfigError, ResilientError

__all__ = [
    "RendezvousError",
    "RendezvousUnavailable",
    "RendezvousStateCorrupt",
    "RendezvousConfigError",
    "RendezvousRoundLost",
]


class RendezvousError(ResilientError, _TorchRendezvousError):
    """Base of resilient's rendezvous errors."""


class RendezvousUnavailable(RendezvousError, _TorchConnectionError):
    """The rendezvous store (etcd) could not be reached within the retry budget.

    The message names the endpoints and the ``etcdctl`` command to check them.
    """


class RendezvousStateCorrupt(RendezvousError, _TorchStateError):
    """The rendezvous state stored in etcd cannot be decoded.

    Someone else wrote the key, or a different resilient/torch version is on
    it. Use a new run id, or delete the key named in the message.
    """


class RendezvousConfigError(RendezvousError, ConfigError):
    """A ``--rdzv-conf`` / ``--rdzv-endpoint`` value is malformed."""


class RendezvousRoundLost(RendezvousError):
    """The completed round this node waits on can no longer start: a member
    stopped sending keep-alives (its node died or was cut off) or a new round
    began. Raised from a store wait instead of waiting out the store timeout;
    the agent answers it by joining the next round."""
