"""The launcher and the zygote end without the interpreter's teardown of torch
(:func:`resilient.procs.exit_without_teardown`), and still do what an exit must: the
threading module's exit hooks and non-daemon threads joined, ``atexit`` functions run,
buffered output flushed, the exit code kept."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = r"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from resilient.procs import exit_without_teardown

out = sys.argv[1]
def late():   # a non-daemon thread still working when the main thread is done
    time.sleep(0.3)
    open(out + ".thread", "w").close()
threading.Thread(target=late).start()
pool = ThreadPoolExecutor(1)   # its threads end through threading's exit hook, not a join alone
pool.submit(time.sleep, 0.1)
atexit.register(lambda: open(out + ".atexit", "w").close())
sys.stdout.write("no newline, still buffered")
exit_without_teardown(3)
print("never")
"""


def test_an_exit_without_teardown_still_joins_runs_atexit_flushes_and_keeps_its_code(tmp_path):
    out = tmp_path / "mark"
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert (tmp_path / "mark.thread").exists() and (tmp_path / "mark.atexit").exists()
