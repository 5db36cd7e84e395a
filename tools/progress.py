"""A one-line byte progress bar on stderr, so long tool runs show they are alive.

Rewritten in place with ``\\r`` and throttled to a few updates per second;
silent when disabled (tests, ``--quiet``) so output stays parseable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts bytes done out of ``total`` and draws ``label  42%  1.2/2.9 GB  310 MB/s``."""

    def __init__(self, label: str, total: int, enabled: bool = True, stream: TextIO | None = None):
        self.label, self.total, self.enabled = label, max(total, 0), enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self._last >= 0.2:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.done / max(now - self.start, 1e-9) / 1e6
        self.stream.write(f"\r{self.label}  {pct:5.1f}%  {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  "
                          f"{rate:,.0f} MB/s ")
        self.stream.flush()
        self._drawn = True

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
