"""The live progress line of a run: step, loss, tokens/s, MFU, committed versions.

On a terminal it rewrites one line in place; into a file or pipe it prints a
line every ``every`` steps, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

# Dense bf16 peak TFLOP/s of known accelerators, for MFU.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.0, "A10G": 125.0, "B200": 2250.0}


def device_peak_tflops(device: str) -> float:
    """Peak TFLOP/s of the local GPU when it is one we know, else 0."""
    if device != "cuda":
        return 0.0
    import torch

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)


class ProgressLine:
    def __init__(self, total_steps: int, stream: TextIO | None = None, every: int = 1):
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.every = max(1, every)
        self.tty = self.stream.isatty()
        self.extra: dict[str, str] = {}
        self._last_len = 0
        self.start = time.monotonic()

    def set(self, key: str, value: str) -> None:
        """Extra fields shown after the training figures (e.g. committed versions per tier)."""
        self.extra[key] = value

    def due(self, step: int) -> bool:
        """Whether :meth:`update` at ``step`` prints (so callers gather extras only then)."""
        return self.tty or step % self.every == 0 or step == self.total

    def update(self, step: int, loss: float, tokens_per_s: float | None, mfu: float | None = None,
               seconds: float | None = None) -> None:
        """``tokens_per_s`` None (a loop that does not count tokens): steps per second from
        ``seconds``, the step's duration."""
        if not self.due(step):
            return
        rate = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s is not None else (
            f"{1 / seconds:,.1f} steps/s" if seconds else "")
        parts = [f"step {step}/{self.total}", f"loss {loss:.4f}", *([rate] if rate else [])]
        if mfu:
            parts.append(f"MFU {100 * mfu:.1f}%")
        parts += [f"{k} {v}" for k, v in self.extra.items()]
        parts.append(f"{time.monotonic() - self.start:.0f}s")
        line = " | ".join(parts)
        if self.tty:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (an eval result, a restore) without breaking the bar."""
        if self.tty and self._last_len:
            self.stream.write("\n")
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()


class Marks:
    """Seconds since the previous mark, per phase name, into ``out`` (run_start's ``startup``)."""

    def __init__(self, out: dict[str, float]):
        self.out, self.last = out, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.out[phase] = round(now - self.last, 4)
        self.last = now
