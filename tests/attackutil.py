"""An unprivileged local user to attack a real job with (tests only).

Why: the job's promise "nobody else can touch it" is about *other local users*:
on a shared host they can reach loopback ports, list ``/dev/shm`` and ``/tmp``,
and create names there before the job does. A test can only show that promise
holds by being such a user. :class:`Attacker` is one: a fresh account made for
the test session (``useradd``, no home, no login shell), which runs Python code
through ``setpriv`` with its own uid and gid, no supplementary groups, no
capabilities and an environment holding nothing of the job (no secret, no run
dir). It runs the system's own interpreter with only the standard library: an
attacker has none of the job's code or credentials.

Tests that need one take the ``attacker`` fixture (``tests/conftest.py``), which
skips, with the reason, where an account cannot be made (not root, no
``useradd``/``setpriv``).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

# The system interpreter: the one under /root (pyenv) is not reachable by other users.
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


def attacker_unavailable() -> str | None:
    """Why an unprivileged attacker account cannot be made here, or None."""
    if os.geteuid() != 0:
        return "making a second local user needs root (euid is not 0)"
    for tool in ("useradd", "userdel", "setpriv"):
        if shutil.which(tool) is None:
            return f"needs {tool} (passwd / util-linux) to act as another local user"
    if _python() is None:
        return f"needs a system Python other users can run (looked for {', '.join(SYSTEM_PYTHONS)})"
    return None


def _python() -> str | None:
    for p in SYSTEM_PYTHONS:
        if os.access(p, os.X_OK):
            return p
    return None


@dataclass
class Attacker:
    """A local user without the job's secret: ``name``, ``uid``, ``gid``."""

    name: str
    uid: int
    gid: int

    @classmethod
    def create(cls) -> "Attacker":
        name = f"rsl-attk-{secrets.token_hex(3)}"
        subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                        "--user-group", name], check=True, capture_output=True)
        pw = pwd.getpwnam(name)
        return cls(name, pw.pw_uid, pw.pw_gid)

    def remove(self) -> None:
        """Delete the account, after killing whatever it still runs."""
        subprocess.run(["pkill", "-KILL", "-u", str(self.uid)], capture_output=True)
        subprocess.run(["userdel", self.name], capture_output=True)

    def argv(self, *argv: str) -> list[str]:
        """``argv`` run as this user: its uid and gid, no other groups, no capabilities."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--", *argv]

    def env(self) -> dict[str, str]:
        """A bare environment: nothing of the job's (no secret, no run dir, no etcd password)."""
        return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}

    def python(self, code: str, *args: str, timeout: timedelta = timedelta(seconds=60),
               cwd: str | os.PathLike = "/tmp") -> subprocess.CompletedProcess:
        """Run ``code`` (dedented) with the system interpreter as this user; ``args`` are its
        ``sys.argv[1:]``. Returns the completed process (text output); never raises on its
        exit code: a refused attack is usually the point."""
        interpreter = _python()
        assert interpreter is not None, attacker_unavailable()
        return subprocess.run(self.argv(interpreter, "-I", "-c", textwrap.dedent(code), *args), env=self.env(),
                              cwd=cwd, capture_output=True, text=True, timeout=timeout.total_seconds())

    def popen(self, code: str, *args: str, cwd: str | os.PathLike = "/tmp") -> subprocess.Popen:
        """Start ``code`` as this user in its own process group (kill it with :func:`os.killpg`)."""
        interpreter = _python()
        assert interpreter is not None, attacker_unavailable()
        return subprocess.Popen(self.argv(interpreter, "-I", "-c", textwrap.dedent(code), *args), env=self.env(),
                                cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def public_dir(self, mode: int = 0o755) -> Path:
        """A new directory under the system temp dir that this user can reach (pytest's own
        ``tmp_path`` sits under a 0700 parent), with ``mode`` (0o1777: world-writable and
        sticky, like /tmp itself). The caller removes it (the ``public_tmp`` fixture does)."""
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="rsl-public-", dir="/tmp"))
        os.chmod(path, mode)
        return path

    def owns(self, path: str | os.PathLike) -> bool:
        return Path(path).lstat().st_uid == self.uid
