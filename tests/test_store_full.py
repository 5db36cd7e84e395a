"""A node store that fills up mid-run (issue 28): the run goes on with the tiers it has, and
says so once, with the right fix, and a ``store_full`` event.

The store is a small tmpfs (``snapshot.store_dir``) in a private mount namespace (tests/nsutil.py),
big enough at launch (the preflight refuses one that is not), filled by a file this test writes
into it mid-run, through the launcher's view of the mounts (``/proc/PID/root``)."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from launchutil import REPO, events, wait_for
from nsutil import blank_file, in_namespace, namespace_unavailable
from resilient.procs import kill_tree

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS = 40
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180),
              pytest.mark.skipif(namespace_unavailable() is not None, reason=str(namespace_unavailable()))]


def fill(path) -> None:
    """Write zeros to ``path`` until its filesystem is full."""
    block = b"\0" * (1 << 20)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e


def test_a_node_store_that_fills_mid_run_warns_once_and_the_run_finishes(tmp_path):
    store, run = tmp_path / "store", tmp_path / "run"
    store.mkdir()
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--run-dir", str(run), "--nproc-per-node", "2",
           "--set", "snapshot.every=1", "--set", f'snapshot.store_dir="{store}"',
           str(EXAMPLE), "--steps", str(STEPS), "--pace", "0.1"]
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(in_namespace(cmd, tmpfs={str(store): "24m"}, blank=blank_file(tmp_path)), cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        local = lambda: [e["step"] for e in events(run, "commit") if e["tier"] == "local"]  # noqa: E731
        wait_for(lambda: max(local(), default=0) >= 5, 120, "the first memory-tier commits")
        fill(f"/proc/{proc.pid}/root{store}/filler")   # the launcher's view: its private tmpfs
        assert proc.wait(150) == 0, log.read_text()[-3000:]
    finally:
        kill_tree(proc)
    text = log.read_text()
    warned = [line for line in text.splitlines() if "is full" in line]
    assert len(warned) == 1, text[-3000:]
    assert "Enlarge /dev/shm" in warned[0] and "snapshot.store_keep" in warned[0], warned[0]
    assert "point the URL elsewhere" not in text, "the durable tier's hint for a full node store"
    (full,) = events(run, "store_full")
    assert full["path"].startswith(str(store)) and full["newest_kept"] is not None
    assert [e["step"] for e in events(run, "run_end")] == [STEPS, STEPS], "the run did not finish"
    assert not (store / "filler").exists()  # the tmpfs was the launcher's alone
