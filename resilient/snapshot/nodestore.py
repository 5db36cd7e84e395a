"""The node store: this node's snapshot versions in shared memory (tmpfs).

Why shared memory owned by the agent: a worker that crashes takes its
process memory with it, but a tmpfs tree belongs to no process. The agent
creates ``STORE_DIR/resilient-<run_id>/<node>/`` before it starts workers
and removes it when it leaves, so a replaced worker finds the last version
on its own node, at memory speed.

Why the durable format (docs/format.md): workers write into the tree with
the same :class:`~resilient.snapshot.Snapshotter` code that writes durable
storage (``file://`` URL, no committer), and restore reads it with the same
chunk/CRC logic. A node's tree holds, per version, the rank files of its own
workers *and* the replicas peers pushed to it, side by side: rank numbers do
not collide within one ``step-S/ATTEMPT``, so "which ranks does node N hold"
is just a directory listing.

Besides versions a tree holds two agent-side helpers (dot names: never a
version, never a store object): ``.spare/``, retired data files that the next
writers rewrite in place (:class:`Spares`), and ``.bell``, the socket ranks
ring when a version landed (:class:`Doorbell`).

Privacy and leaks (:mod:`.storeroot`): trees live under ``STORE_DIR/resilient-u<uid>/``,
0700 and checked before use. ``owner.json`` records the owning agent's pid and its start
time. A tree whose agent died, or stopped with its run unfinished, is kept for a relaunch
of the same run and node, which adopts it; other runs' dead trees are reclaimed after a
day or when the tmpfs runs short, and a finished run's agent removes its run's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable


from resilient.snapshot.api import SnapshotIncomplete, StorageError
from resilient.procs import OWNER, owner_alive, owner_record
from resilient.snapshot.format import crc, parse_version_dir, version_dir
from resilient.snapshot.mapping import MAPPINGS, mapped
from resilient.snapshot.storefull import out_of_space
from resilient.snapshot.storeroot import KEPT, private_dir, private_root, reclaim_other_runs, reclaim_run, user_root

SPARES = ".spare"  # retired data files, rewritten in place by the next writers (see Spares)
BELL = ".bell"     # the agent's doorbell socket: a rank rings it when a version landed (see Doorbell)
COMMITTED = "committed.json"  # {"local": step, "peer": step}: the agent's newest commits, for progress lines
# Everything a store holds has one of these names; anything else is refused (no "..", no absolute paths).
_REL = re.compile(r"step-[0-9]{12}/[0-9a-zA-Z]{1,40}-[0-9]{6}/r[0-9]{5}(-p[0-9]{4}\.bin|\.json)")
_RANK = re.compile(r"/r(\d{5})(?:-p\d{4}\.bin|\.json)$")


def job_dir(base: str | os.PathLike, run_id: str) -> Path:
    """A run's directory of node trees, under this user's private root (:mod:`.storeroot`)."""
    return user_root(base) / f"resilient-{run_id}"


def reclaim(base: str | os.PathLike, run_id: str) -> list[str]:
    """Remove this run's trees whose agent is gone (the run is over: nothing will adopt them)."""
    return reclaim_run(base, run_id)


def check_rel(rel: str) -> str:
    """Raise ValueError unless ``rel`` is a store object name (``step-S/ATTEMPT/rRRRRR...``)."""
    if not isinstance(rel, str) or not _REL.fullmatch(rel):
        raise ValueError(f"{rel!r} is not a snapshot store object name")
    return rel


def rank_of(rel: str) -> int:
    m = _RANK.search(rel)
    if m is None:
        raise ValueError(f"{rel!r} names no rank")
    return int(m.group(1))


@contextlib.contextmanager
def _locked(tree: Path):
    """An exclusive ``flock`` on the directory ``tree`` (not followed if a link), released on exit
    or when the holder dies."""
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LocalVersion:
    """Rank manifests present in the store for one ``step-S/ATTEMPT``."""

    step: int
    attempt: str
    ranks: frozenset[int]
    mtime: float


class NodeStore:
    """One node's tree: create/remove, list, read ranges, write atomically, retention."""

    def __init__(self, base: str | os.PathLike, run_id: str, node: str):
        self.base, self.run_id, self.node = Path(base), run_id, node
        self.path = job_dir(base, run_id) / node

    @property
    def url(self) -> str:
        return self.path.as_uri()

    # -- life cycle -------------------------------------------------------------
    def create(self) -> list[str]:
        """Check this user's private root (:func:`~.storeroot.private_root`: refused, never used, if
        another user could reach it), drop other runs' stale dead trees, then create our tree, or
        adopt the one a dead agent of this run and node left (``self.adopted``: its versions, which
        a restore may use once every byte authenticates). Returns the trees reclaimed."""
        private_root(self.base)
        try:
            reclaimed = reclaim_other_runs(self.base, self.run_id)
        except OSError:
            reclaimed = []
        self.adopted: list[LocalVersion] = []
        if self.path.exists():
            private_dir(self.path, "the node store")  # ours, 0700, not a link: else refused
            # Two relaunches of one node adopting its kept tree at once (a supervisor and an
            # operator, say): the check and the owner's write under one lock, so only one adopts
            # and the other finds it alive.
            with _locked(self.path):
                if owner_alive(self.path):
                    raise StorageError(f"{self.path}: another live agent owns node {self.node!r} of run "
                                       f"{self.run_id!r}; give this node another --node-id", str(self.path))
                self._adopt()
            return reclaimed
        # Born with its owner file: built under a hidden name, then renamed into
        # place, so an agent starting at the same moment never sees our tree
        # without an owner and reclaims it as dead.
        tmp = self.path.parent / f".{self.node}.creating-{os.getpid()}"
        for attempt in range(100):
            try:
                tmp.parent.mkdir(mode=0o700, exist_ok=True)
                tmp.mkdir(mode=0o700, exist_ok=True)
                break
            except FileNotFoundError:
                # Another agent's reclaim (or remove) took the run's directory, or this user's
                # root, while it was still empty, between our mkdir of it and of our tree:
                # make it again, checked as the first time.
                if attempt == 99:
                    raise
                private_root(self.base)
        (tmp / OWNER).write_text(owner_record(node=self.node))
        try:
            os.rename(tmp, self.path)
        except OSError:   # another agent of this node made its tree first (ENOTEMPTY)
            shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(f"{self.path}: another agent created node {self.node!r} of run {self.run_id!r} at "
                               "the same moment; give this node another --node-id", str(self.path)) from None
        return reclaimed

    def _adopt(self) -> None:
        tmp = self.path / f".{OWNER}.adopt-{os.getpid()}"
        tmp.write_text(owner_record(node=self.node))
        os.replace(tmp, self.path / OWNER)
        with contextlib.suppress(FileNotFoundError):
            (self.path / KEPT).unlink()
        self.adopted = self.versions()

    def keep(self, reason: str) -> None:
        """Leave the tree for a relaunch of this run (its job is unfinished): the files stay, marked
        :data:`~.storeroot.KEPT`; :mod:`.storeroot` bounds how long."""
        MAPPINGS.clear()
        with contextlib.suppress(OSError):
            (self.path / KEPT).write_text(json.dumps({"time": time.time(), "reason": reason}))

    def remove(self) -> None:
        MAPPINGS.clear()  # they would keep the removed files' pages alive
        shutil.rmtree(self.path, ignore_errors=True)
        for empty in (self.path.parent, self.path.parent.parent):  # the run's directory, this user's root
            try:
                empty.rmdir()
            except OSError:
                break

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def version_bytes(self, step: int) -> int:
        """Bytes the files of ``step``'s version take in this store (every attempt, own shards and
        peers' replicas alike): what the next version will need again."""
        total = 0
        for top, _, files in os.walk(self.path / version_dir(step)):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(top, name)).st_size
        return total

    # -- commit status ----------------------------------------------------------
    def publish_committed(self, committed: dict[str, int]) -> None:
        """The agent's newest commit per memory tier, for its workers' progress lines
        (tmpfs: a write and a rename per commit).

        A store that is full to the page still commits versions (each one takes the pages
        retention freed from the one it retires), but the new file here takes a page of
        its own before the rename frees the old one: the write failed, and the workers
        showed the local tier stale while it went on committing (CI's store-full test). The
        file is then rewritten in place, in the page it already holds."""
        text = json.dumps(committed)
        tmp = self.path / f".{COMMITTED}.tmp"
        try:
            tmp.write_text(text)
            os.replace(tmp, self.path / COMMITTED)
        except OSError as e:  # else the store is being removed; nobody will read it
            if out_of_space(e):
                with contextlib.suppress(OSError):
                    tmp.unlink()
                self._rewrite_committed(text)

    def _rewrite_committed(self, text: str) -> None:
        try:
            with open(self.path / COMMITTED, "r+b") as f:
                old = len(f.read())
                f.seek(0)
                f.write(text.encode().ljust(old))  # JSON with trailing spaces: one write, no shorter file
                f.truncate()
        except OSError:  # none yet (its first write failed), or the store is going
            pass

    def read_committed(self) -> dict[str, int]:
        """What :meth:`publish_committed` last wrote (empty before the first commit).

        A read that meets a rewrite in place may hold half the old text and half the new,
        which can even parse ("19" → "20" read as "29"): a read counts once the next one
        gives the same bytes (a few tries; else nothing is shown this time)."""
        path, last = self.path / COMMITTED, None
        for _ in range(4):
            try:
                raw = path.read_bytes()
            except OSError:
                return {}
            if raw == last:
                try:
                    got = json.loads(raw)
                except ValueError:
                    return {}
                return {k: v for k, v in got.items() if isinstance(v, int)} if isinstance(got, dict) else {}
            last = raw
        return {}

    # -- contents ---------------------------------------------------------------
    def versions(self) -> list[LocalVersion]:
        """Every ``step-S/ATTEMPT`` with at least one rank manifest, oldest first."""
        out = []
        try:
            steps = list(os.scandir(self.path))
        except FileNotFoundError:
            return out
        for sd in steps:
            step = parse_version_dir(sd.name)
            if step is None or not sd.is_dir():
                continue
            try:
                attempts = list(os.scandir(sd.path))
            except FileNotFoundError:
                continue
            for ad in attempts:
                if not ad.is_dir():  # a stray file beside the attempts names no version
                    continue
                try:
                    names = [e for e in os.scandir(ad.path) if e.name.endswith(".json")]
                    ranks = frozenset(int(e.name[1:6]) for e in names if re.fullmatch(r"r\d{5}\.json", e.name))
                    mtime = max((e.stat().st_mtime for e in names), default=0.0)
                except (FileNotFoundError, ValueError):
                    continue
                if ranks:
                    out.append(LocalVersion(step, ad.name, ranks, mtime))
        return sorted(out, key=lambda v: (v.step, v.mtime))

    def rank_files(self, step: int, attempt: str, rank: int) -> list[str]:
        """Relative names of a rank's objects, data parts first, its manifest last."""
        adir = self.path / version_dir(step) / attempt
        parts = sorted(e.name for e in os.scandir(adir) if e.name.startswith(f"r{rank:05d}-p") and e.name.endswith(".bin"))
        return [f"{version_dir(step)}/{attempt}/{n}" for n in parts] + [f"{version_dir(step)}/{attempt}/r{rank:05d}.json"]

    def file(self, rel: str) -> Path:
        return self.path / check_rel(rel)

    def read(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self.file(rel)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise SnapshotIncomplete(f"{path}: not in node {self.node}'s store", str(path)) from None
        if length is not None and len(data) != length:
            raise SnapshotIncomplete(f"{path}: holds {offset + len(data)} bytes, wanted {offset + length}", str(path))
        return data

    def read_into(self, rel: str, offset: int, out: memoryview) -> memoryview:
        """Read ``len(out)`` bytes at ``offset`` straight into ``out``: what :meth:`read`
        returns, without the bytes object in between (one copy fewer on a restore)."""
        path = self.file(rel)
        try:
            got = readinto_at(path, offset, out)
        except FileNotFoundError:
            raise SnapshotIncomplete(f"{path}: not in node {self.node}'s store", str(path)) from None
        if got != len(out):
            raise SnapshotIncomplete(f"{path}: holds {offset + got} bytes, wanted {offset + len(out)}", str(path))
        return out

    def writer(self, rel: str) -> "AtomicWriter":
        """A writer of ``rel``; FileNotFoundError once the store was removed (a peer's push
        arriving after the agent closed it must not build a new, ownerless tree that no
        reclaim would ever find)."""
        path = self.file(rel)  # step-S/ATTEMPT/name: two directory levels below the store
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: node {self.node}'s store is gone")
        make_version_dirs(path.parent)
        return AtomicWriter(path, self.spares)

    @property
    def spares(self) -> "Spares":
        return Spares(self.path / SPARES)

    def retain(self, keep: set[int], below: int) -> list[int]:
        """Delete version directories of steps ``<= below`` not in ``keep``; returns the steps
        removed. Their data files become spares first (up to ``Spares.limit``)."""
        removed = []
        spares = self.spares
        for sd in list(os.scandir(self.path)) if self.path.exists() else []:
            step = parse_version_dir(sd.name)
            if step is not None and step <= below and step not in keep:
                spares.retire(Path(sd.path))
                shutil.rmtree(sd.path, ignore_errors=True)
                removed.append(step)
        return sorted(removed)


class Spares:
    """Retired data files of a node store, kept to be rewritten in place.

    Why: every version is written into fresh tmpfs files (by the workers, and by the
    peer server for replicas) while an older one is deleted. A fresh file costs the
    kernel a page allocation and zero-fill per 4 KiB and the delete frees them again:
    measured here, writing a fresh file costs ~1.5x overwriting an existing one of the
    same size. Versions are the same size step after step, so retention moves a retired
    version's part files here, and a writer claims one (an atomic rename: two writers
    never get the same file) and overwrites it. Only files no version names any more
    are spares, so a reader of a live version never sees its bytes change; a reader
    still holding a retired file open sees bad checksums and falls back, as for any
    bad copy."""

    limit = 8  # files; enough for a few ranks' parts per version, bounded RAM

    def __init__(self, path: Path):
        self.path = path

    def retire(self, version_dir: Path) -> None:
        try:
            have = len(os.listdir(self.path))
        except FileNotFoundError:
            have = 0
        for root, _, names in os.walk(version_dir):
            for name in names:
                if have >= self.limit or not name.endswith(".bin"):
                    continue
                try:
                    self.path.mkdir(mode=0o700, exist_ok=True)
                    os.rename(os.path.join(root, name), self.path / f"{name}.{uuid.uuid4().hex}")
                    have += 1
                except OSError:  # the store is going away, or the file is gone: not worth keeping
                    pass

    def bytes(self) -> int:
        """What the spare files take (a new version rewrites them instead of growing the store)."""
        try:
            return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(self.path))
        except OSError:
            return 0

    def claim(self, target: Path, like: str = "") -> bool:
        """Move a spare file to ``target`` (in the same store); False if none is left.
        ``like``: the name the file will have (``r00003-p0000.bin``); a spare that had that
        name is taken first, since the writer of that rank most likely still has it mapped
        (:class:`~resilient.snapshot.mapping.Mappings`)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return False
        if like:
            names.sort(key=lambda n: not n.startswith(like + "."))
        for name in names:
            try:
                os.rename(self.path / name, target)
                return True
            except FileNotFoundError:  # another writer claimed it first
                continue
        return False


# A Unix socket's name holds at most 107 bytes (sun_path less its NUL).
_SOCKET_NAME_MAX = 107


@contextlib.contextmanager
def _socket_name(path: Path):
    """The name to bind or send to for a socket file at ``path``.

    Why: store paths under a deep ``/dev/shm`` or temp root (pytest-xdist's, a container's)
    pass the 107 bytes a socket name may hold. A longer path is reached through a descriptor
    of its directory, ``/proc/self/fd/N/<name>``, which the kernel resolves like the path
    itself: same file, same permissions."""
    name = str(path)
    if len(os.fsencode(name)) <= _SOCKET_NAME_MAX:
        yield name
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


class Doorbell:
    """A datagram socket in the store that the agent waits on and each rank rings after
    writing its rank manifest.

    Why: the replicator otherwise lists the store every 50 ms to see whether a version
    landed, on every node, all run long, snapshots or not; measured in the 2-node overhead
    job that listing alone was ~2.5 ms of CPU per training step per agent. A ring is one
    ``sendto``. Rings are hints: a lost one (a full socket buffer, an agent not listening
    yet) costs only latency, because the agent still lists the store every ``fallback``."""

    def __init__(self, store_path: Path):
        self.path = store_path / BELL
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            try:
                os.unlink(self.path)  # left by an earlier agent of this store (it is ours now)
            except FileNotFoundError:
                pass
            with _socket_name(self.path) as name:
                self.sock.bind(name)
        except OSError:  # the agent lists instead
            self.sock.close()
            self.sock = None

    def wait(self, timeout: timedelta) -> bool:
        """Wait up to ``timeout`` for a ring (False: none came, or no socket)."""
        if self.sock is None:
            return False
        self.sock.settimeout(timeout.total_seconds())
        try:
            self.sock.recv(64)
        except (socket.timeout, OSError):
            return False
        self.sock.setblocking(False)
        try:
            while self.sock.recv(64):  # several rings, one wake-up
                pass
        except OSError:
            pass
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.path)
            except OSError:
                pass

    @staticmethod
    def ring(path: Path) -> None:
        """Ring the doorbell at ``path``; never blocks, never fails (rings are hints)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, _socket_name(path) as name:
                s.setblocking(False)
                s.sendto(b"1", name)
        except OSError:
            pass


def make_version_dirs(attempt_dir: Path) -> None:
    """``STORE/step-S/ATTEMPT``'s two directories, 0700; never the store itself: a store that is
    gone (its agent left, or someone moved it) is not re-created by a writer, with whatever mode
    and owner its parent would give it (FileNotFoundError instead)."""
    for d in (attempt_dir.parent, attempt_dir):
        d.mkdir(mode=0o700, exist_ok=True)


def _private_file(path: str, flags: int) -> int:
    """``open``'s opener for store files: 0600, and never through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


def readinto_at(path: str | os.PathLike, start: int, out: memoryview) -> int:
    """Read up to ``len(out)`` bytes of a local file from ``start`` into ``out``; returns how
    many (fewer at the end of the file). FileNotFoundError passes through."""
    got = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while got < len(out):
            n = f.readinto(out[got:])
            if not n:
                break
            got += n
    return got


def open_for_rewrite(tmp: Path, spares: "Spares | None", like: str = ""):
    """``tmp`` opened for writing from its start: a claimed spare if one is left (rewritten
    in place; the caller truncates it to what it wrote), else a new file. ``like``: the
    final name, to get back a spare that had it (:meth:`Spares.claim`)."""
    if spares is not None and spares.claim(tmp, like):
        try:
            return open(tmp, "r+b", opener=_private_file)
        except FileNotFoundError:  # retention of a removed store: start afresh
            pass
    return open(tmp, "w+b", opener=_private_file)  # readable too: receive() maps it


class AtomicWriter:
    """Stream bytes into a temporary file, check size and CRC-32, then rename into place.

    No fsync: tmpfs has nothing to flush, and a store does not outlive the machine anyway."""

    def __init__(self, path: Path, spares: Spares | None = None):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.f = open_for_rewrite(self.tmp, spares if path.suffix == ".bin" else None, path.name)
        self.crc = 0
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.crc = crc(data, self.crc)
        self.size += len(data)

    def receive(self, size: int, fill: Callable[[memoryview], None], piece: int,
                check: Callable[[int, memoryview], None] | None = None) -> None:
        """Make the file ``size`` bytes and fill it in place, ``fill(view)`` per ``piece``
        bytes (a socket's ``recv_into``), checksumming each piece while it is in the cache;
        or, with ``check``, handing it to ``check(offset, view)`` instead (the chunk MACs of
        a vouched put: :class:`~resilient.snapshot.auth.ChunkStream`; then :meth:`commit`
        takes no CRC).

        Why a shared mapping (:func:`mapped`): receiving into a buffer and then ``write``
        copies every byte twice; this lands them once (with the sender's CRC taken from the
        manifest, a 7 MB push went from 13.9 to 8.7 ms of CPU for both ends:
        ``bench/push_cost.py``)."""
        with mapped(self.f, size) as whole:
            for i in range(0, size, piece):
                with whole[i:i + piece] as view:
                    fill(view)
                    if check is None:
                        self.crc = crc(view, self.crc)
                    else:
                        check(i, view)
                    self.size += len(view)

    def commit(self, size: int, crc: int | None) -> None:
        """Rename into place if ``size`` bytes came with CRC-32C ``crc`` (None: checked
        otherwise, the size alone here)."""
        self.f.truncate()  # a rewritten spare may have been longer
        self.f.close()
        if self.size != size or (crc is not None and self.crc & 0xFFFFFFFF != crc & 0xFFFFFFFF):
            self.abort()
            if crc is None:
                raise OSError(f"{self.path}: received {self.size} bytes, sender said {size}")
            raise OSError(f"{self.path}: received {self.size} bytes crc32c {self.crc & 0xFFFFFFFF:08x}, "
                          f"sender said {size} bytes crc32c {crc & 0xFFFFFFFF:08x}")
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.f.close()
            os.unlink(self.tmp)
        except OSError:
            pass
