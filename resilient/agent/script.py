"""One worker of a user's script: ``main(["SCRIPT", *args])`` or ``main(["-m", "MODULE", *args])``.

The entry module the agent's warm processes run for ``resilient launch SCRIPT``
(see :mod:`resilient.agent.warm`): it runs the script in this process as
``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` would under torchrun, with
torchrun's environment already set by the agent. ``sys.argv`` is
``[SCRIPT, *args]``; ``sys.path[0]`` is the script's directory (the current
directory for ``-m``). The exit code is the script's: ``sys.exit(n)`` gives
``n``; an uncaught exception prints its traceback, records a ``worker_error``
event in ``RUN_DIR/events.jsonl`` (what the agent quotes when it gives up) and
exits 1.
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import sys
import traceback


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m resilient.agent.script",
                                 description="Run a user's training script as one worker.")
    ap.add_argument("-m", dest="module", action="store_true", help="TARGET is a module (python -m)")
    ap.add_argument("target", help="the script's path, or the module's name with -m")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return ap.parse_args(argv)


def _exit_code(e: SystemExit) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


def _script_frames(tb):
    """The traceback without our frames and runpy's: what ``python SCRIPT`` would print."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return tb


def run(module: bool, target: str, args: list[str]) -> int:
    """Run the script or module as ``__main__``; its exit code."""
    try:
        if module:
            sys.argv = [target, *args]  # run_module sets argv[0] to the module's file
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as e:
        return _exit_code(e)
    except BaseException as e:
        from resilient.contract import said_peer_gone
        from resilient.events import record_worker_error

        if said_peer_gone(e):   # after this worker's clean run_end: a peer that left, not an error
            return 0
        text = "".join(traceback.format_exception(type(e), e, _script_frames(e.__traceback__)))
        sys.stderr.write(text)
        record_worker_error(e, text)
        return 1


def main(argv: list[str]) -> int:
    a = _parse(argv)
    code = run(a.module, a.target, a.args)
    # The script's atexit handlers run as at the end of `python SCRIPT`; then leave at once, as
    # the built-in worker does: interpreter shutdown with gloo's threads alive can hang.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
