"""RNG states as JSON, for a snapshot's per-rank ``extra``.

Restarting with the same RNG streams is part of bitwise-identical resume.
States are base64 of torch's own byte tensors (no pickle)."""

from __future__ import annotations

import base64
import random

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict:
    """torch CPU (+ CUDA current device), Python ``random``, and named generators."""
    py = random.getstate()
    out = {"torch": _b64(torch.get_rng_state()),
           "python": [py[0], list(py[1]), py[2]],
           "generators": {k: _b64(g.get_state()) for k, g in (generators or {}).items()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = _b64(torch.cuda.get_rng_state())
    return out


def set_rng_state(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    for k, g in (generators or {}).items():
        if k in state.get("generators", {}):
            g.set_state(_unb64(state["generators"][k]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
