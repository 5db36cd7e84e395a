"""The job runner the tests, the benchmarks and the chaos harness share
(resilient_chaos.launched): a node's whole tree dies with it, whatever it spawned, and a
wait that runs out says what the node printed."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from resilient_chaos.launched import LaunchedNode, WaitTimedOut, launch_argv, run_events, wait_for

# A "node": a launcher that starts a worker in a session of its own (as torchrun does: the
# group alone would miss it), prints both pids, then waits.
NODE = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print("pids", child.pid, flush=True)
    time.sleep(600)
""")


def _pids(node: LaunchedNode) -> int:
    line = wait_for(lambda: next((ln for ln in node.output().splitlines() if ln.startswith("pids ")), None), 60,
                    "the node's worker")
    return int(line.split()[1])


def test_kill_takes_the_whole_tree_even_a_worker_in_its_own_session(tmp_path: Path):
    with LaunchedNode([sys.executable, "-c", NODE], tmp_path / "node.log") as node:
        worker = _pids(node)
        assert node.alive() and psutil.pid_exists(worker)
        t = node.kill()
        assert t <= time.time()
        assert not node.alive()
        assert wait_for(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie", 30,
                        "the worker gone")
        assert node.proc.returncode == -signal.SIGKILL


def test_a_wait_that_runs_out_is_an_assertion_and_a_timeout_naming_the_output(tmp_path: Path):
    with LaunchedNode([sys.executable, "-c", "print('still here', flush=True); import time; time.sleep(600)"],
                      tmp_path / "node.log", env={"RESILIENT_TEST_MARK": "x"}) as node:
        wait_for(lambda: "still here" in node.output(), 60, "its first line")
        with pytest.raises(WaitTimedOut, match="still here") as raised:
            node.wait(0.2)
        assert isinstance(raised.value, AssertionError) and isinstance(raised.value, TimeoutError)
        with pytest.raises(TimeoutError, match="waiting for nothing"):
            wait_for(lambda: None, 0.1, "nothing", interval=0.02)
        assert psutil.Process(node.pid).environ()["RESILIENT_TEST_MARK"] == "x"
    assert not node.alive() and node._log.closed


def test_a_node_started_with_term_with_parent_dies_with_the_thread_that_started_it(tmp_path: Path):
    """A campaign runner killed by SIGKILL leaves no job behind: its agents get SIGTERM."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = {sys.path!r}
        from resilient_chaos.launched import LaunchedNode
        node = LaunchedNode([sys.executable, "-c", "import time; time.sleep(600)"], {str(tmp_path / 'inner.log')!r},
                            term_with_parent=True)
        print(node.pid, flush=True)
        time.sleep(600)
    """)
    with LaunchedNode([sys.executable, "-c", script], tmp_path / "outer.log") as runner:
        inner = int(wait_for(lambda: runner.output().strip(), 60, "the inner node's pid"))
        os.kill(runner.pid, signal.SIGKILL)   # not the group: the inner node is in a session of its own
        wait_for(lambda: not psutil.pid_exists(inner) or psutil.Process(inner).status() == "zombie", 30,
                 "the inner node gone with its parent")


def test_launch_argv_puts_options_before_the_target_and_the_script_args_after(tmp_path: Path):
    argv = launch_argv("train.py", tmp_path, node_id="n1", nnodes="1:2", endpoint="h:1", nproc=2,
                       overrides=["a.b=1"], extra_args=["--domain", "d"], script_args=["--lr", "3"])
    assert argv[:4] == [sys.executable, "-m", "resilient.cli", "launch"]
    assert argv[4:] == ["--run-dir", str(tmp_path), "--node-id", "n1", "--nnodes", "1:2", "--rdzv-endpoint", "h:1",
                        "--nproc-per-node", "2", "--set", "a.b=1", "--domain", "d", "train.py", "--lr", "3"]


def test_run_events_leaves_out_a_line_being_written(tmp_path: Path):
    assert run_events(tmp_path) == []
    (tmp_path / "events.jsonl").write_text('{"event": "step", "step": 1}\n{"event": "st')
    assert run_events(tmp_path) == [{"event": "step", "step": 1}] and run_events(tmp_path, "commit") == []
