"""Small helpers of the SDC monitor: the model's parts and parameter names, the
device a suspicion names, and the hooks' own clock."""

from __future__ import annotations

import os
import socket
from typing import Sequence

import torch
from torch import nn

from resilient.contract import NODE_ID_ENV
from resilient.sdc.api import Spent

Parts = nn.Module | Sequence[nn.Module]


def _timed(fn):
    """Count a hook's wall and CPU time into :meth:`SdcMonitor.overhead_seconds`."""
    def wrapper(self, *a, **kw):
        t0 = Spent.now()
        try:
            return fn(self, *a, **kw)
        finally:
            self._spent.since(t0)
    wrapper.__doc__, wrapper.__name__, wrapper.__wrapped__ = fn.__doc__, fn.__name__, fn
    return wrapper


def _parts(model_parts: Parts) -> list[nn.Module]:
    return [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)


def _named_params(model_parts: Parts) -> list[tuple[str, nn.Parameter]]:
    out = []
    for i, m in enumerate(_parts(model_parts)):
        prefix = f"{i}:" if not isinstance(model_parts, nn.Module) else ""
        out += [(prefix + n, p) for n, p in m.named_parameters()]
    return out


def device_id(device: torch.device | str | None = None) -> str:
    """``host:cuda:N`` (or ``host:cpu:pid``): what a quarantine names."""
    host = os.environ.get(NODE_ID_ENV) or socket.gethostname()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return f"{host}:cpu:{os.getpid()}"
    return f"{host}:{device.type}:{device.index if device.index is not None else 0}"
