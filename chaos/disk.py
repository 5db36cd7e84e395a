"""Full-disk faults: a small tmpfs the scenario points storage at, filled on
demand.

The durable tier (or the local spill directory) of a disk-full scenario is
pointed at a :class:`SmallVolume` (a tmpfs of a few MiB mounted for the run).
:class:`FillDisk` then fills it to the last byte with a filler file, so every
further write fails with ENOSPC, and deleting the filler on clear frees it.
Filling is refused on filesystems larger than ``max_bytes`` so that a wrong
path can never fill the host's real disk (or /dev/shm, shared with others).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from .injectors import InjectionFailed, Injector

CMD_TIMEOUT = timedelta(seconds=10)
FILLER = ".chaos-filler"
FILL_ATTEMPTS = 5


def mount_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (euid is not 0)"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "'mount'/'umount' are not installed"
    return None


class SmallVolume:
    """A tmpfs of ``size_bytes`` mounted at a fresh directory (or ``path``).

    ``url`` is its ``file://`` URL for ``snapshot.durable_url``. Unmounted
    (and the directory removed) by ``close()`` / ``with``, even after a
    failure, with a lazy unmount if something still holds it open.
    """

    def __init__(self, size_bytes: int = 8 << 20, path: str | os.PathLike | None = None) -> None:
        self.size_bytes = size_bytes
        self._own_dir = path is None
        self.path = Path(path) if path else Path(tempfile.mkdtemp(prefix="rchaos-vol-"))
        self.mounted = False

    @property
    def url(self) -> str:
        return f"file://{self.path}"

    def mount(self) -> "SmallVolume":
        reason = mount_unavailable()
        if reason:
            raise InjectionFailed(f"cannot mount a small volume: {reason}")
        self.path.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0755", "tmpfs", str(self.path)],
                           capture_output=True, text=True, timeout=CMD_TIMEOUT.total_seconds())
        if p.returncode:
            raise InjectionFailed(f"mount tmpfs at {self.path} failed: {p.stderr.strip()}")
        self.mounted = True
        return self

    def close(self) -> None:
        if self.mounted:
            p = subprocess.run(["umount", str(self.path)], capture_output=True, timeout=CMD_TIMEOUT.total_seconds())
            if p.returncode:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=CMD_TIMEOUT.total_seconds())
            self.mounted = False
        if self._own_dir:
            shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "SmallVolume":
        return self.mount()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def small_volume(path: str | os.PathLike, max_bytes: int = 1 << 30) -> bool:
    """Whether ``path`` is on a filesystem small enough for :class:`FillDisk` to fill."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_blocks * st.f_frsize <= max_bytes


class FillDisk(Injector):
    """Fill the filesystem holding ``path`` until writes raise ENOSPC.

    Verified by a probe write that must fail with ENOSPC. Refuses (raises
    :class:`InjectionFailed`) on a filesystem bigger than ``max_bytes``.
    """

    kind = "disk-full"

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = 1 << 30, **kw: Any) -> None:
        super().__init__(**kw)
        self.path, self.max_bytes = Path(path), max_bytes
        self.filler = self.path / f"{FILLER}-{self.fault_id}"

    def _inject(self) -> str:
        st = os.statvfs(self.path)
        total = st.f_blocks * st.f_frsize
        if total > self.max_bytes:
            raise InjectionFailed(f"refusing to fill {self.path}: its filesystem has {total} bytes > max_bytes {self.max_bytes}; point the scenario at a SmallVolume")
        # The job may free space while we fill (retention deletes old
        # versions): fill, probe, and fill again what was freed, a few times.
        written = 0
        for attempt in range(FILL_ATTEMPTS):
            written += self._fill()
            if self._probe_full():
                break
        else:
            raise InjectionFailed(f"filled {written} bytes in {FILL_ATTEMPTS} rounds but a 4 KiB write to {self.path} still succeeds")
        return f"filled {written} bytes on {self.path}; writes raise ENOSPC"

    def _fill(self) -> int:
        """Append to the filler until ENOSPC, with ever smaller writes."""
        written = 0
        block = b"\0" * (1 << 20)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            size = len(block)
            while size:
                try:
                    written += os.write(fd, block[:size])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    size //= 2
        finally:
            os.close(fd)
        return written

    def _probe_full(self) -> bool:
        """True when a 4 KiB write fails with ENOSPC (the observed effect)."""
        probe = self.path / f".chaos-probe-{self.fault_id}"
        try:
            with open(probe, "wb") as f:
                f.write(b"x" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise InjectionFailed(f"probe write on {self.path} failed with {e}, not ENOSPC") from e
            return True
        finally:
            probe.unlink(missing_ok=True)
        return False

    def _clear(self) -> None:
        self.filler.unlink(missing_ok=True)


class FillStore(FillDisk):
    """Fill the filesystem of the node stores (``snapshot.store_dir``, a SmallVolume): every
    rank's next versions fail to land in RAM, and the job must go on with the other tiers,
    saying so once (``store_full``)."""

    kind = "store-full"
