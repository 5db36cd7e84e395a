"""A node store that fills up mid-run (issue 28): the run goes on with the tiers it has, and
says so once, with the right fix, and a ``store_full`` event.

The store is a small tmpfs (``snapshot.store_dir``) in a private mount namespace (tests/nsutil.py),
big enough at launch (the preflight refuses one that is not), filled by a file this test writes
into it mid-run, through the launcher's view of the mounts (``/proc/PID/root``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launchutil import REPO, events, wait_for
from nsutil import blank_file, in_namespace, namespace_unavailable, run_isolated
from resilient.procs import kill_tree

EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS = 40
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(180),
              pytest.mark.skipif(namespace_unavailable() is not None, reason=str(namespace_unavailable()))]


class Hog(threading.Thread):
    """Keeps the filesystem of ``path`` full: writes zeros to ``path`` until it is, then takes
    every page freed there (each few ms) until stopped.

    Why not fill it once: a store full to the page is not one that refuses versions. The
    agent's retention frees the pages of the version each new one retires, and a version
    that lands right after takes them: from then on every version fit, nothing failed and
    nobody warned (CI saw it once). Here a freed page goes to the hog first, as a store
    that is really out of room would have it."""

    def __init__(self, path: str):
        super().__init__(name="hog", daemon=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.stop, self.full = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        block = b"\0" * (1 << 20)
        try:
            while not self.stop.is_set():
                for size in (1 << 20, 4096):  # the big blocks first, then the single pages left
                    try:
                        while True:
                            os.write(self.fd, block[:size])
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                self.full.set()
                self.stop.wait(0.005)
        except BaseException as e:  # re-raised by __exit__: the store may not have stayed full
            self.error = e
            self.full.set()

    def __enter__(self) -> "Hog":
        self.start()
        if not self.full.wait(30) or self.error is not None:
            self.__exit__()
            raise AssertionError("the store never filled")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(10)
        os.close(self.fd)
        assert not self.is_alive(), "the hog did not stop"
        if self.error is not None:
            raise AssertionError(f"the hog failed: {self.error!r}") from self.error


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
        with Hog(f"/proc/{proc.pid}/root{store}/filler"):   # the launcher's view: its private tmpfs
            assert proc.wait(150) == 0, log.read_text()[-3000:]
    finally:
        kill_tree(proc)
    text = log.read_text()
    warned = [line for line in text.splitlines() if "is full" in line]
    assert len(warned) == 1, text[-3000:]
    assert "Enlarge /dev/shm" in warned[0] and "snapshot.store_keep" in warned[0], warned[0]
    assert "point the URL elsewhere" not in text, "the durable tier's hint for a full node store"
    (full,) = events(run, "store_full")
    assert Path(full["path"]).is_relative_to(store) and full["newest_kept"] is not None
    assert [e["step"] for e in events(run, "run_end")] == [STEPS, STEPS], "the run did not finish"
    assert not (store / "filler").exists()  # the tmpfs was the launcher's alone


PUBLISH = """
import errno, os, sys
from resilient.snapshot.nodestore import NodeStore
base = sys.argv[1]
store = NodeStore(base, "run-x", "n0")
store.create()
store.publish_committed({"local": 4, "peer": 3})
with open(os.path.join(base, "filler"), "wb", buffering=0) as f:
    try:
        while True:
            f.write(bytes(4096))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
store.publish_committed({"local": 5, "peer": 4, "commit_us": 1234})
print("read back", store.read_committed(), "free", os.statvfs(base).f_bavail)
"""


def test_the_agents_commits_reach_its_workers_from_a_store_full_to_the_page(tmp_path):
    """The committed-steps file the workers' progress lines read is rewritten in place when
    the store has no page for a new one (it went on showing the step before the store filled)."""
    base = tmp_path / "store"
    base.mkdir()
    out = run_isolated(in_namespace([sys.executable, "-c", PUBLISH, str(base)], tmpfs={str(base): "256k"},
                                    blank=blank_file(tmp_path)), cwd=REPO)
    assert out.returncode == 0, out.stdout
    assert "read back {'local': 5, 'peer': 4, 'commit_us': 1234} free 0" in out.stdout, out.stdout
