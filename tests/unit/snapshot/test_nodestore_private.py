"""A node store is private by construction (issue 39, item 2): its trees live under a
0700 root of the job's user, checked without following links before each use. A root or
parent another local user made, or one open to group/other, or a link, is refused with
StoreNotPrivate (naming the fix) and nothing is written there; the store's files are
0600 and a writer never re-creates a store that was moved away."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from resilient.snapshot import Snapshotter
from resilient.snapshot.nodestore import NodeStore
from resilient.snapshot.storeroot import StoreNotPrivate, user_root

SECRET = b"p" * 40


def _sticky_base(parent) -> str:
    """A base like /dev/shm: world-writable and sticky, owned by the job's user."""
    base = parent / "shm"
    base.mkdir()
    os.chmod(base, 0o1777)
    return str(base)


def test_a_root_another_user_planted_is_refused_and_left_untouched(attacker, public_tmp):
    os.chmod(public_tmp, 0o755)
    base = _sticky_base(public_tmp)
    planted = user_root(base)
    got = attacker.python("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", str(planted))
    assert got.returncode == 0, got.stderr
    with pytest.raises(StoreNotPrivate, match=f"belongs to uid {attacker.uid}.*Remove it as root"):
        NodeStore(base, "job", "n0").create()
    assert attacker.owns(planted) and os.listdir(planted) == []  # never used: nothing of the job in it
    assert isinstance(StoreNotPrivate("x"), PermissionError)


def test_a_base_owned_by_another_user_is_refused(attacker, public_tmp):
    os.chmod(public_tmp, 0o1777)
    base = public_tmp / "theirs"
    got = attacker.python("import os, sys; os.mkdir(sys.argv[1], 0o755)", str(base))
    assert got.returncode == 0, got.stderr
    with pytest.raises(StoreNotPrivate, match="belongs to uid"):
        NodeStore(base, "job", "n0").create()
    assert os.listdir(base) == []


def test_a_loose_or_linked_root_and_a_non_sticky_shared_base_are_refused(tmp_path):
    base = _sticky_base(tmp_path)
    root = user_root(base)
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    with pytest.raises(StoreNotPrivate, match="mode 0777"):
        NodeStore(base, "job", "n0").create()
    root.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    root.symlink_to(elsewhere)
    with pytest.raises(StoreNotPrivate, match="not a directory of its own"):
        NodeStore(base, "job", "n0").create()
    assert os.listdir(elsewhere) == []
    open_base = tmp_path / "open"
    open_base.mkdir()
    os.chmod(open_base, 0o777)  # world-writable, not sticky: anyone could rename our root away
    with pytest.raises(StoreNotPrivate, match="not sticky"):
        NodeStore(open_base, "job", "n0").create()


def test_store_files_are_private_and_a_moved_store_is_not_recreated(tmp_path):
    old = os.umask(0o022)
    try:
        store = NodeStore(_sticky_base(tmp_path), "job", "n0")
        store.create()
        state = {"w": torch.arange(6.0)}
        with Snapshotter(store.url, commit=False, secret=SECRET, compress="none") as snap:
            snap.save(1, state, force=True)
            assert snap.wait() and snap.upload_error(1) is None
            modes = {}
            for dirpath, dirs, files in os.walk(user_root(store.base)):
                for n in dirs + files:
                    p = os.path.join(dirpath, n)
                    modes[os.path.relpath(p, store.base)] = stat.S_IMODE(os.lstat(p).st_mode)
            assert len(modes) > 4 and all(m & 0o077 == 0 for p, m in modes.items() if not p.endswith("owner.json")), modes
            moved = store.path.with_name("moved")
            os.rename(store.path, moved)  # what an attacker did when the parent was theirs
            snap.save(2, state, force=True)
            snap.wait()
            assert snap.upload_error(2) is not None
        assert not store.path.exists(), "a writer re-created the store"
        os.rename(moved, store.path)
        store.remove()
    finally:
        os.umask(old)


def test_two_relaunches_adopting_one_kept_tree_at_once_only_one_adopts(tmp_path):
    """The owner check and the owner's write happen under the tree's lock: a second relaunch that
    reaches the kept tree while the first is adopting it waits, then finds it alive, and refuses."""
    import json
    import subprocess
    import threading

    from resilient.procs import OWNER, owner_record
    from resilient.snapshot.api import StorageError
    from resilient.snapshot.nodestore import _locked

    base = _sticky_base(tmp_path)
    kept = NodeStore(base, "job", "n0")
    kept.create()
    gone = subprocess.Popen(["true"])
    gone.wait()
    (kept.path / OWNER).write_text(json.dumps({"pid": gone.pid, "pid_started": 0.0, "pid_ticks": -1}))  # died
    got: list = []

    def second() -> None:
        try:
            got.append(NodeStore(base, "job", "n0").create())
        except StorageError as e:
            got.append(e)

    try:
        with _locked(kept.path):   # the first relaunch, between its check and its owner's write
            t = threading.Thread(target=second, daemon=True)
            t.start()
            t.join(0.5)
            assert t.is_alive() and not got, "the second relaunch did not wait for the first's adoption"
            (kept.path / OWNER).write_text(owner_record(node="n0"))
        t.join(60)
        assert len(got) == 1 and isinstance(got[0], StorageError) and "another live agent owns" in str(got[0])
    finally:
        kept.remove()
