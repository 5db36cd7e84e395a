"""The run dir is its user's alone: created private, refused when someone else could have set it up.

Why: a run dir holds what a job must not show or take from anyone: the single-machine job
secret (``job.secret``), the durable checkpoints by default (``RUN_DIR/checkpoints``:
weights, optimizer, RNG and data position), the events and the configs. Created under the
process umask (022 is the common default) they were 0755/0644, and another local user read
every checkpoint file. And a run dir in a shared place (``/tmp/run``) that another user made
first (0777, with a ``job.secret`` of theirs in it) was adopted: that user knew the secret,
so could log in to the embedded etcd and write records with valid MACs.

The rules, whatever the umask:

- a run dir is created 0700. One that exists must be a directory (not a link) owned by this
  user and not writable by its group or others; its parent must not let others replace it
  (writable by others without the sticky bit). Anything else is :class:`RunDirUnsafe`, whose
  message gives the fix. An existing run dir that others may only *read* (made by ``mkdir``
  or an older version) is used as it is: everything the job puts in it is private, below.
- the private subdirectories (the ``file://`` durable tier when it lies in the run dir, the
  ledger: :mod:`resilient.ledger`) are 0700, narrowed if an older version made them wider;
- files are opened without following a link (``O_NOFOLLOW``), created 0600, narrowed to
  0600 if they exist wider (an ``events.jsonl`` of an older version), and refused if
  another user owns them; whole files are written aside and renamed into place
  (:func:`write_private`), so a reader never sees half of one.

What this cannot do: make a run dir private on a file system that ignores modes (some
network mounts); put such run dirs on a private path.
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
from pathlib import Path

from resilient.errors import ResilientError

__all__ = ["RunDirUnsafe", "private_dir", "open_private", "write_private", "owner_name", "local_path"]


class RunDirUnsafe(ResilientError, PermissionError):
    """A run dir, or a file in it, could have been made or changed by another user (owned by
    someone else, writable by others, a link): the job refuses to use it, rather than hand
    that user its secret or load what they wrote."""


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _check_dir(path: Path, st: os.stat_result, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise RunDirUnsafe(f"{what} {path} is a symbolic link (to {os.readlink(path)!r}): whoever made it chose where "
                           f"the job writes. Pass the directory itself, or remove the link ({path}) if it is not yours")
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirUnsafe(f"{what} {path} exists and is not a directory; pass another --run-dir")
    if st.st_uid != os.geteuid():
        raise RunDirUnsafe(
            f"{what} {path} is owned by {owner_name(st.st_uid)}, not by you ({owner_name(os.geteuid())}): "
            f"another user made it, and could read or plant what the job keeps there (its secret, its "
            f"checkpoints). Use a run dir of your own (e.g. under your home), or remove {path} if you know "
            f"where it came from")
    if st.st_mode & 0o022:
        raise RunDirUnsafe(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: its group or other users can write it, so "
            f"they could have planted files in it (a job secret of theirs, a link). If it is yours, check what "
            f"is in it, then `chmod 700 {path}`; or pass a new --run-dir (the job creates it 0700)")


def _check_parent(path: Path, what: str) -> None:
    """Others must not be able to rename ``path`` away and put theirs in its place: a parent
    writable by others needs the sticky bit (as /tmp has)."""
    parent = path.parent
    try:
        st = os.stat(parent)
    except OSError:
        return
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise RunDirUnsafe(f"the parent of {what} {path} ({parent}, mode {stat.S_IMODE(st.st_mode):04o}) lets every "
                           f"user replace it (writable by others, no sticky bit): put the run dir in a directory of "
                           f"your own")


def private_dir(path: str | os.PathLike, what: str = "run dir", narrow: bool = False) -> Path:
    """``path`` as a directory only this user can change: created 0700 (missing parents too) if
    absent, else checked (module docstring). ``narrow``: an existing one readable
    by others is made 0700 (a subdirectory the job owns, not a run dir a user chose)."""
    path = Path(path)
    missing = [p for p in path.parents if not os.path.lexists(p)]
    for parent in reversed(missing):   # as mkdir -p, but 0700: under umask 0 a 0777 parent is refused below
        try:
            os.mkdir(parent, 0o700)
        except FileExistsError:
            pass
    _check_parent(path, what)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:   # a link (ELOOP), a file (ENOTDIR): said by the checks of what is there
        _check_dir(path, os.lstat(path), what)
        raise
    try:
        st = os.fstat(fd)
        _check_dir(path, st, what)
        if created or (narrow and st.st_mode & 0o077):
            os.fchmod(fd, 0o700)   # mkdir's mode went through the umask
    finally:
        os.close(fd)
    return path


def open_private(path: str | os.PathLike, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 what: str = "file") -> int:
    """An fd of ``path`` opened with ``flags``, not through a link; created 0600; an existing
    file of this user that others could read is narrowed to 0600; one of another user refused."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if os.path.islink(path):
            raise RunDirUnsafe(f"{what} {path} is a symbolic link: the job writes only to files it made. Remove "
                               f"the link if it is not yours ({e.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RunDirUnsafe(f"{what} {path} is owned by {owner_name(st.st_uid)}, not by you: another user made "
                               f"it. Remove it (check how it got there) or use another run dir")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str | os.PathLike, data: bytes | str, fsync: bool = False) -> Path:
    """Write ``data`` as ``path`` (mode 0600): into a new file beside it, then renamed into
    place, so a reader sees the old file or the new one, never half of one or a link's target."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data.encode() if isinstance(data, str) else data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)   # a full disk leaves no half-written temp file
        raise
    return path


def local_path(url: str) -> Path | None:
    """The local directory of a ``file://`` URL or a bare path (as fsspec reads them), else None."""
    if "://" not in url:
        return Path(url).resolve()
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(url).path)).resolve()
    return None
