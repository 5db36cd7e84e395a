"""Build a small C source into a shared library once per machine, and load it safely.

The library is cached under ``$XDG_CACHE_HOME/resilient/native`` (default
``~/.cache``), named by a key over the source, the compiler and the CPU (a
cache shared between hosts must not hand one CPU's ``-march=native`` build to
another) and by a hash of its own bytes. Loading checks that hash first:
``dlopen`` of a truncated file (a host that crashed mid-write, a full disk)
does not fail cleanly, it kills the process with SIGBUS, so a file whose bytes
do not match its name is deleted and built again instead of loaded.

Several processes of a cold machine may build at once: each compiles to a
private temp file and links it under its final name; the first link wins,
the others find the name taken (same source, same compiler: equivalent bytes)
and load that. A build that fails or hangs leaves a ``.failed`` note, so the
workers and restarts after it fall back at once instead of paying the compile
timeout again; it is retried after :data:`RETRY_FAILED_AFTER`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("resilient.sdc.native")

COMPILE_TIMEOUT = timedelta(seconds=30)       # the build takes ~0.3 s; a hung compiler must not stall workers
RETRY_FAILED_AFTER = timedelta(hours=1)
FLAGS = ["-x", "c", "-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-strict-aliasing", "-fPIC", "-shared"]


class BuildError(OSError):
    """The compiler failed, hung, or its output could not be stored."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "resilient" / "native"


def compiler() -> str | None:
    """``$CC`` (default ``cc``), else gcc or clang, as a path; None without one."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _stem(source: Path, cc: str) -> str:
    st = os.stat(cc)
    key = hashlib.sha256(b"\0".join([source.read_bytes(), cc.encode(), str((st.st_size, st.st_mtime_ns)).encode(),
                                     _cpu_key().encode(), " ".join(FLAGS).encode()])).hexdigest()[:20]
    return f"{source.stem}-{key}"


def _load_verified(folder: Path, stem: str) -> ctypes.CDLL | None:
    """The first cached build of ``stem`` whose bytes match its name; bad ones are deleted."""
    for path in sorted(folder.glob(f"{stem}-*.so")):
        try:
            good = _digest(path.read_bytes()) == path.stem.rsplit("-", 1)[1]
            lib = ctypes.CDLL(str(path)) if good else None
        except OSError:
            lib = None
        if lib is not None:
            return lib
        log.warning("resilient.sdc: removing a damaged build %s", path)
        try:
            path.unlink()
        except OSError:
            pass
    return None


def _compile(cc: str, source: Path, out: str) -> None:
    for arch in (["-march=native"], []):   # -march=native is gcc/clang on x86/arm; retry without
        # its own session, so a timeout kills the driver's children (cc1, as, ld) too
        proc = subprocess.Popen([cc, *FLAGS, *arch, "-o", out, str(source)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=COMPILE_TIMEOUT.total_seconds())
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BuildError(f"{cc} did not finish in {COMPILE_TIMEOUT.total_seconds():.0f} s") from None
        if proc.returncode == 0:
            return
    raise BuildError(f"{cc} failed: {err.strip()[-500:]}")


def _build(cc: str, source: Path, folder: Path, stem: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=stem, suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        _compile(cc, source, tmp)
        with open(tmp, "rb") as f:
            data = f.read()
            os.fsync(f.fileno())             # durable before its name says it is whole
        os.chmod(tmp, 0o755)                 # other users sharing the cache may load it
        final = folder / f"{stem}-{_digest(data)}.so"
        try:
            os.link(tmp, final)              # first wins; a concurrent builder's file is equivalent
        except FileExistsError:
            pass
        from resilient.snapshot.storage import fsync_dir   # here: the kernels' importers need no fsspec
        fsync_dir(folder)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path) -> ctypes.CDLL | None:
    """``source`` built (on first use) and loaded; None, with one warning, where impossible."""
    cc = compiler()
    if cc is None:
        log.warning("resilient.sdc: no C compiler on PATH; SDC checks use torch kernels (slower, same answers)")
        return None
    try:
        folder, stem = cache_dir(), _stem(source, cc)
        failed = folder / f"{stem}.failed"
        lib = _load_verified(folder, stem) if folder.is_dir() else None
        if lib is not None:
            return lib
        if failed.exists() and time.time() - failed.stat().st_mtime < RETRY_FAILED_AFTER.total_seconds():
            log.warning("resilient.sdc: building %s failed recently (%s); SDC checks use torch kernels until %s",
                        source.name, failed.read_text().strip(), "the note is an hour old or removed")
            return None
        try:
            _build(cc, source, folder, stem)
        except (OSError, subprocess.SubprocessError) as e:
            try:
                failed.write_text(f"{e}\n")
            except OSError:
                pass
            raise BuildError(str(e)) from e
        return _load_verified(folder, stem)
    except OSError as e:
        log.warning("resilient.sdc: could not build %s (%s); SDC checks use torch kernels (slower, same answers)",
                    source.name, e)
        return None
