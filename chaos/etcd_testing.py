"""Helpers for tests that need a real etcd (imported by tests and benchmarks only; needs pytest).

Why here and not in a conftest: the etcd, rendezvous, agent and chaos suites and the
benchmarks all need the same "start a real etcd, skip clearly if the binary is missing,
always clean up" fixture. Not in the runtime (``resilient/``), which never imports pytest:
in the harness above it, with the chaos runner's own job machinery.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pytest

from resilient.etcd.api import EtcdNotFound
from resilient.etcd.client import EtcdClient
from resilient.etcd.server import EmbeddedEtcd
from resilient.procs import kill_tree

__all__ = ["embedded_etcd", "unique_run_id", "kill_group", "make_tls_files", "enable_auth"]


@contextlib.contextmanager
def embedded_etcd(**kwargs: object) -> Iterator[EmbeddedEtcd]:
    """A started :class:`EmbeddedEtcd`; skips the test if no etcd binary exists."""
    try:
        server = EmbeddedEtcd(**kwargs)  # type: ignore[arg-type]
    except EtcdNotFound as exc:
        pytest.skip(str(exc))
    with server:
        yield server


def unique_run_id(prefix: str = "test") -> str:
    """A run id no other test (or earlier run against the same etcd) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def kill_group(proc: subprocess.Popen, timeout: timedelta = timedelta(seconds=10)) -> None:
    """SIGKILL ``proc``, its process group and every descendant, and reap them."""
    kill_tree(proc, timeout)


def make_tls_files(directory: Path) -> tuple[str, str, str]:
    """A throwaway CA and one certificate for 127.0.0.1 (server and client use).

    Returns ``(ca_cert, cert, key)`` paths. Skips the test without ``openssl``.
    """
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=resilient-test-ca")
    (directory / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "ext.cnf")
    return tuple(str(directory / n) for n in ("ca.pem", "node.pem", "node.key"))  # type: ignore[return-value]


def enable_auth(client: EtcdClient, root_password: str) -> None:
    """Create etcd's ``root`` user with ``root_password`` and turn authentication on."""
    client._post("/auth/user/add", {"name": "root", "password": root_password}, "user add")
    client._post("/auth/role/add", {"name": "root"}, "role add")
    client._post("/auth/user/grant", {"user": "root", "role": "root"}, "user grant")
    client._post("/auth/enable", {}, "auth enable")
