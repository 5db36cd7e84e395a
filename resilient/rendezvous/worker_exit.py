"""torchrun workers that end cleanly whether or not the script destroys its process group.

torch 2.13 aborts now and then at the exit of a worker whose script never called
``destroy_process_group()`` (the mechanism: ``worker_site/sitecustomize.py``). The etcd3
rendezvous runs inside torchrun's agent, whose environment every worker inherits, so it puts
``worker_site/`` first on ``PYTHONPATH``: each worker's interpreter then imports that
folder's ``sitecustomize`` at start, which destroys the default group at exit if the script
left it, and runs any ``sitecustomize`` it shadows. ``--rdzv-conf destroy_at_exit=false``
turns it off; ``resilient launch`` does (its workers leave with ``os._exit``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping

__all__ = ["SITE_DIR", "install_worker_exit_hook"]

SITE_DIR = Path(__file__).resolve().with_name("worker_site")


def install_worker_exit_hook(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put :data:`SITE_DIR` first on ``environ``'s ``PYTHONPATH`` (once), for the processes
    started from it."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE_DIR) not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *paths])
