"""A warm worker process: ``python -m resilient.agent.warm``.

Imports torch and everything a worker needs (≈ 3-4 s, the bulk of a cold
start), then blocks on stdin for one assignment: a JSON line with the
environment (rank, world size, master address, ...) and the worker's
arguments. It then becomes that worker. The agent keeps such processes ready
so that replacing a failed worker costs a pipe write, not an import.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the agent dies (Linux); exit now if it
    already has. Set by the child itself: ``preexec_fn`` is unsafe in a
    parent that runs threads, as the agent does."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = os.environ.get("RESILIENT_PARENT_PID")
    if parent and os.getppid() != int(parent):
        os._exit(1)


def _preload() -> None:
    # What a worker imports on its way to the first step.
    import torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import resilient.train  # noqa: F401
    import resilient.worker  # noqa: F401


def main() -> int:
    die_with_parent()
    _preload()
    line = sys.stdin.readline()
    if not line:
        return 0  # the agent closed the pipe: not needed
    assignment = json.loads(line)
    os.environ.update(assignment["env"])
    sys.stdin.close()
    from resilient.worker import main as worker_main

    return worker_main(assignment["argv"])


if __name__ == "__main__":
    sys.exit(main())
