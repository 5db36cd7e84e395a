"""CPU priority of the snapshot tiers' background threads.

Why: on a host that trains, every cycle a checksum, a tmpfs write, a
replication push or its receipt takes is a cycle the training threads do not
get, and with data parallelism one delayed rank delays every rank at the
next collective. Linux applies ``nice`` per thread, so each background
thread lowers its own priority when it starts: the scheduler then runs it in
the gaps (collectives, data loading) instead of in the middle of a step.
"""

from __future__ import annotations

import os
import threading

UPLOAD_NICE = 10      # a rank's writers (node store, durable tier): they must keep up with the snapshot rate
REPLICATION_NICE = 19  # the agent's replicator and its peer server: the peer tier may lag a step, training may not


def background_priority(nice: int = UPLOAD_NICE) -> None:
    """Lower the calling thread's CPU priority to ``nice`` (no-op where unsupported)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass
