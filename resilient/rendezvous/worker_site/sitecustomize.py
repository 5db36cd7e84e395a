"""A torchrun worker's first import (resilient.rendezvous.worker_exit put this folder first on
its PYTHONPATH): end the default process group before the interpreter finalizes.

Why: a script that never calls ``destroy_process_group()`` (most do not) leaves gloo's work
threads running into interpreter exit. The thread that finished the last collective drops
its work object a moment after the main thread returned from ``wait()``; if the main thread
has reached finalization by then (a loaded host deschedules the work thread), releasing the
work's tensors needs the GIL, CPython ends the thread (``pthread_exit``) inside a
``noexcept`` destructor, and the process aborts: "terminate called without an active
exception", exit -6, and torchrun reports a finished job FAILED (4 of 30 runs on a loaded
2-core host, on torch's c10d rendezvous as on ours). Destroying the group at exit joins those
threads while the interpreter is whole. The hook is registered first, so it runs after
every handler the script registers (they may still use the group).

Then the ``sitecustomize`` this one shadows, if any, runs as it would have.
"""

import atexit
import os
import sys


def _end_process_group() -> None:
    dist = sys.modules.get("torch.distributed")  # never imports torch for a script that did not
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # the script has ended; say so, do not change its exit code
        print(f"resilient: ending the process group at exit failed: {exc!r}", file=sys.stderr)


def _run_shadowed() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


atexit.register(_end_process_group)
_run_shadowed()
