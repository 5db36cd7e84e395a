"""Files that ship with resilient and are found wherever it is installed.

Why: ``resilient launch configs/demo.toml`` names the config relative to a checkout;
after ``pip install`` the working directory is anywhere, so a ``configs/NAME.toml``
that is not there resolves to the copy the wheel carries in the package
``resilient_configs`` (the repository's ``configs/``, pyproject.toml). Every config
file is read through :func:`resilient.configbase.read_toml`, which falls back here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["shipped_config", "shipped_config_dir"]


def shipped_config_dir() -> Path | None:
    """The installed ``configs/`` directory, or None (located without importing it)."""
    spec = importlib.util.find_spec("resilient_configs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def shipped_config(path: str | os.PathLike) -> Path | None:
    """The shipped config a relative ``configs/NAME.toml`` names, or None (any other path,
    or a name that is not shipped). Only that form: it is what the README, the configs'
    own comments and the chaos scenarios write."""
    p = Path(path)
    if p.is_absolute() or len(p.parts) != 2 or p.parts[0] != "configs" or p.suffix != ".toml":
        return None
    base = shipped_config_dir()
    found = base / p.name if base is not None else None
    return found if found is not None and found.is_file() else None
