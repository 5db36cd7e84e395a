"""Shared fixtures, and the markers a test's folder gives it. Fixtures of one subsystem live in
its own test files.

``tests/unit/<part>/``: one part of the tree, in process (a real etcd where it needs one),
marked ``unit``; ``tests/integration/``: jobs, agents and workers as real processes, marked
``integration``. ``pytest -m unit`` runs the quick half; the helpers (``launchutil`` ...)
sit in ``tests/`` itself.
"""

from __future__ import annotations

import os

import pytest

from launchutil import CORPUS_TEXT_BYTES


def pytest_collection_modifyitems(config, items):
    # Run the files in the order of their names, whatever their folder (a stable sort: each
    # file's tests stay together, in their order), as before the split: the multi-process
    # files then alternate with in-process ones on pytest-xdist's two workers instead of
    # running two at a time at the start, each job's idle waits filled by the other's work.
    items.sort(key=lambda item: item.path.name)
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if parts[:2] == ("tests", "unit"):
            item.add_marker(pytest.mark.unit)
        elif parts[:2] == ("tests", "integration"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def reclaim_what_killed_agents_leave():
    """At the end of the session, remove the node-store trees in /dev/shm and the agents'
    heartbeat dirs whose owner process is dead (tests kill agents with -9). A later agent
    reclaims them anyway, but after the last test there is none. Live owners (another
    session's tests on this machine) are left alone."""
    yield
    import tempfile

    from resilient.procs import reclaim_dirs
    from resilient.snapshot.storeroot import drop_dead

    if os.path.isdir("/dev/shm"):
        drop_dead("/dev/shm")
    reclaim_dirs(tempfile.gettempdir(), "resilient-agent-")


@pytest.fixture(autouse=True)
def pythonpath_as_it_was():
    """An etcd3 rendezvous handler made in this process puts the torchrun workers' exit hook
    first on PYTHONPATH (resilient.rendezvous.worker_exit); later tests' processes (agents,
    workers that leave with os._exit) must not inherit it."""
    saved = os.environ.get("PYTHONPATH")
    yield
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="session")
def attacker():
    """A second local user without the job's secret (tests/attackutil.py), for the whole
    session; skips, with the reason, where one cannot be made."""
    from attackutil import Attacker, attacker_unavailable

    why = attacker_unavailable()
    if why is not None:
        pytest.skip(why)
    user = Attacker.create()
    try:
        yield user
    finally:
        user.remove()


@pytest.fixture
def public_tmp(attacker):
    """A directory under /tmp that the attacker can reach (mode 0755; chmod it for more),
    removed after the test, whatever the attacker left in it."""
    path = attacker.public_dir()
    try:
        yield path
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small byte-level corpus built from the Python standard library."""
    from resilient.gpt.data import prepare

    return prepare("python-stdlib", tmp_path_factory.mktemp("corpus"), max_bytes=CORPUS_TEXT_BYTES)


@pytest.fixture(scope="module")
def etcd():
    """A real etcd server for the tests of one module (skips if no binary)."""
    from resilient_chaos.etcd_testing import embedded_etcd

    with embedded_etcd() as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API: moto's server on loopback (as s3fs's own tests do), with
    a bucket "ckpt". Credentials and region come from the environment. One
    server per session: moto keeps its buckets in process-global state, so
    servers started per module would share them anyway. Tests use distinct
    prefixes under the bucket."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}.items():
        mp.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).makedirs("ckpt", exist_ok=True)
    try:
        yield endpoint
    finally:
        server.stop()
        mp.undo()


@pytest.fixture
def job_secret(monkeypatch):
    """A fresh job secret in this process's environment (``$RESILIENT_JOB_SECRET``), as a
    scheduler would provide it; child processes inherit it. Returns the :class:`JobSecret`."""
    import secrets

    from resilient.secret import SECRET_ENV, SECRET_FILE_ENV, JobSecret

    value = secrets.token_hex(32)
    monkeypatch.setenv(SECRET_ENV, value)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    return JobSecret(value.encode(), SECRET_ENV)


@pytest.fixture
def restore_share_env():
    """Creating an etcd3 rendezvous handler sets its SHARE_STORE_ENV process-wide; undo it per test."""
    from resilient.rendezvous.registry import SHARE_STORE_ENV

    saved = os.environ.get(SHARE_STORE_ENV)
    yield
    if saved is None:
        os.environ.pop(SHARE_STORE_ENV, None)
    else:
        os.environ[SHARE_STORE_ENV] = saved


@pytest.fixture
def peer_server(tmp_path):
    """A node store with a peer server on loopback, authenticated with ``bytes(range(32))``
    (tests/unit/snapshot/test_peer_auth.py, tests/unit/snapshot/test_peer_mac.py): ``(store, server)``."""
    from resilient.snapshot.nodestore import NodeStore
    from resilient.snapshot.peer import PeerServer

    store = NodeStore(tmp_path, "job", "n0")
    store.create()
    srv = PeerServer(store, bytes(range(32)), host="127.0.0.1")
    yield store, srv
    srv.close()
    store.remove()


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A run dir of the job's user (0700) with its job.secret, and the secret as the job has it
    (none in the environment). A test file's own ``job`` fixture takes precedence."""
    from resilient.secret import SECRET_ENV, SECRET_FILE_ENV, provide_job_secret

    for key in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    run = tmp_path / "run"
    return run, provide_job_secret(run)
