"""Where node stores live: a private root per user, and the trees dead agents left in it.

Why a private root: a node store holds the job's weights and is what a restart restores
from. Its path was predictable (``/dev/shm/resilient-<run id>``, the run id a hash of
the run dir) and nobody checked who owned it: another local user pre-created it 0777,
moved the agent's tree aside, read the weights and put poisoned ones in their place.
Now every tree lives under ``STORE_DIR/resilient-u<uid>/``, created 0700 by its user
and checked before each use without following links (``O_NOFOLLOW``): owned by this
user and closed to group and other, else refused (:class:`StoreNotPrivate`, naming
the fix), never used. Inside it nobody else can create, rename or read anything, so
the names below it need not be secret. ``STORE_DIR`` itself must be owned by this user
or root, and sticky where others may write it (``/dev/shm``, ``/tmp``): otherwise
another user could rename the root away.

Kept trees (issue 38): an agent that dies (``kill -9``, a lost machine's restart aside)
or stops with its job unfinished (lost control plane, preemption) leaves its tree, and
a relaunch of the same run and node on this machine adopts it
(:meth:`~.nodestore.NodeStore.create`) and restores from it when every byte
authenticates, before the durable tier. Bounded: a dead tree of another run is removed
by the next agent on this machine once it has been idle :data:`KEEP_DEAD` (a day),
or at once, oldest first, while the tmpfs has less than a quarter free (a later job
needs the space); the agent that finishes a run removes that run's dead trees; and
``resilient store ls`` / ``resilient store drop`` list and remove them by hand.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from resilient.procs import OWNER, owner_alive
from resilient.snapshot.api import StorageError

KEEP_DEAD = timedelta(days=1)   # a dead agent's tree of another run is kept this long after its last write
FREE_SHARE = 0.25               # below this share of the tmpfs free, dead trees of other runs go first
KEPT = "kept.json"              # {"time", "reason"}: the agent stopped with its run unfinished and kept it
_PRIVATE = 0o077


class StoreNotPrivate(StorageError, PermissionError):
    """A node store's directory (or its parent) is not private to the job's user: owned by another
    user, open to group or other, or a symbolic link. Never used; the message names the fix."""

    def __init__(self, message: str, obj: str | None = None):
        StorageError.__init__(self, message, obj)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def user_root(base: str | os.PathLike) -> Path:
    """This user's root of node stores under ``base`` (``snapshot.store_dir``); not checked."""
    return Path(base) / f"resilient-u{os.geteuid()}"


def _check_base(base: Path) -> None:
    try:
        st = os.stat(base)
    except FileNotFoundError:
        os.makedirs(base, mode=0o700, exist_ok=True)
        st = os.stat(base)
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise StoreNotPrivate(f"snapshot.store_dir {base} is not a directory; point it at a tmpfs (/dev/shm)", str(base))
    if st.st_uid not in (me, 0):
        raise StoreNotPrivate(f"snapshot.store_dir {base} belongs to uid {st.st_uid}, not to this user ({me}) or "
                              "root: its owner could move the node store aside; use /dev/shm or a directory you own",
                              str(base))
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StoreNotPrivate(f"snapshot.store_dir {base} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by other "
                              f"users and not sticky: they could rename the node store away. `chmod +t {base}` "
                              "(as /dev/shm is), or use a directory only you can write", str(base))


def private_dir(path: Path, what: str) -> None:
    """Create ``path`` (mode 0700) if absent; then check, without following a link, that it is a
    directory of this user closed to group and other. :class:`StoreNotPrivate` otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: a file in its place
        raise StoreNotPrivate(f"{what} {path} is not a directory of its own ({e.strerror}): another user may have "
                              f"planted it. Remove it (as root if need be) and relaunch", str(path)) from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    me = os.geteuid()
    if st.st_uid != me:
        raise StoreNotPrivate(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({me}): another user "
                              "made it before this job did (an attack, or a leftover of another account). Remove it "
                              "as root, or set snapshot.store_dir to a directory only you can write, and relaunch",
                              str(path))
    if st.st_mode & _PRIVATE:
        raise StoreNotPrivate(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or other users may "
                              f"enter it, so what is in it cannot be trusted. Remove it (`rm -rf {path}`) and "
                              "relaunch; it is made 0700", str(path))


def privacy_problem(base: str | os.PathLike) -> str | None:
    """Why node stores under ``base`` would be refused (:class:`StoreNotPrivate`'s message), or
    None; creates nothing (the preflight asks before anything starts)."""
    base = Path(base)
    try:
        if base.exists():
            _check_base(base)
        root = user_root(base)
        if os.path.lexists(root):
            private_dir(root, "the node-store root")
    except StoreNotPrivate as e:
        return str(e)
    return None


def private_root(base: str | os.PathLike) -> Path:
    """This user's root under ``base``, created 0700 if absent and checked (see the module doc)."""
    base = Path(base)
    _check_base(base)
    root = user_root(base)
    private_dir(root, "the node-store root")
    return root


# ------------------------------------------------------------------ kept trees
@dataclass(frozen=True)
class KeptTree:
    """A node tree under this user's root: its run, node, whether its agent lives, and its size."""

    path: Path
    run_id: str
    node: str
    alive: bool
    kept: bool          # its agent stopped with the run unfinished (else: it died)
    idle_s: float       # seconds since its last write
    nbytes: int


def _last_write(tree: Path) -> float:
    newest = 0.0
    try:
        for e in os.scandir(tree):
            try:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    except OSError:
        pass
    return newest


def _size(tree: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(tree):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def node_trees(base: str | os.PathLike, sizes: bool = False) -> list[KeptTree]:
    """Every node tree (one with an owner file) under this user's root, oldest write first."""
    root = user_root(base)
    out = []
    now = time.time()
    try:
        jobs = [j for j in os.scandir(root) if j.name.startswith("resilient-") and j.is_dir(follow_symlinks=False)]
    except OSError:
        return out
    for job in jobs:
        try:
            trees = [t for t in os.scandir(job.path) if not t.name.startswith(".") and t.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for t in trees:
            path = Path(t.path)
            if not (path / OWNER).exists():
                continue  # not an agent's tree: never ours to judge
            out.append(KeptTree(path, job.name.removeprefix("resilient-"), t.name, owner_alive(path),
                                (path / KEPT).exists(), max(0.0, now - _last_write(path)),
                                _size(path) if sizes else 0))
    return sorted(out, key=lambda k: -k.idle_s)


def drop(tree: KeptTree) -> None:
    shutil.rmtree(tree.path, ignore_errors=True)
    for empty in (tree.path.parent, tree.path.parent.parent):  # the run's directory, this user's root
        try:
            empty.rmdir()
        except OSError:
            break


def reclaim_other_runs(base: str | os.PathLike, run_id: str) -> list[str]:
    """Dead trees of other runs that are past :data:`KEEP_DEAD`, then (oldest first) while the
    tmpfs has less than :data:`FREE_SHARE` free: removed. Returns ``run/node`` of each."""
    removed = []
    dead = [t for t in node_trees(base) if not t.alive and t.run_id != run_id]
    for t in dead:
        if t.idle_s > KEEP_DEAD.total_seconds() or _short_of_space(base):
            drop(t)
            removed.append(f"{t.run_id}/{t.node}")
    return removed


def reclaim_run(base: str | os.PathLike, run_id: str, but: str | None = None) -> list[str]:
    """The run finished: remove its dead trees on this machine (but node ``but``'s, the caller's own)."""
    removed = []
    for t in node_trees(base):
        if t.run_id == run_id and t.node != but and not t.alive:
            drop(t)
            removed.append(t.node)
    return removed


def _short_of_space(base: str | os.PathLike) -> bool:
    try:
        st = os.statvfs(base)
    except OSError:
        return False
    return st.f_blocks > 0 and st.f_bavail < FREE_SHARE * st.f_blocks


def drop_dead(base: str | os.PathLike) -> list[str]:
    """Remove every tree under this user's root whose agent is gone (a test session's end:
    its killed jobs will never be relaunched). Returns ``run/node`` of each."""
    gone = [t for t in node_trees(base) if not t.alive]
    for t in gone:
        drop(t)
    return [f"{t.run_id}/{t.node}" for t in gone]
