"""Matplotlib for the pictures campaigns and benchmarks draw, when it is installed.

Why: the pictures are for people (a campaign's timeline, a benchmark's bars); the numbers
beside them are the record. Matplotlib is the ``plot`` extra, which the README's first
command does not install, so a missing matplotlib must cost the picture, never the run's
report or a benchmark's row: :func:`pyplot` says once how to get the pictures and returns
None, and each drawing function then draws nothing."""

from __future__ import annotations

import sys
from types import ModuleType

INSTALL_HINT = "pip install 'resilient[plot]'  (or, in a checkout: pip install -e '.[plot]')"

_told = False


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or None when matplotlib
    is not installed; the first None also prints, on stderr, what to install."""
    global _told
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _told:
            _told = True
            print(f"pictures (PNG) skipped: matplotlib is not installed; for them: {INSTALL_HINT}",
                  file=sys.stderr, flush=True)
        return None
    return plt
