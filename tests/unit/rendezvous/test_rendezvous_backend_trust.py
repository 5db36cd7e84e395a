"""The etcd3 rendezvous backend keeps torch's backend contract, and nothing unauthenticated reaches torch.

The contract is the one torch checks in its own rendezvous backend suite
(``RendezvousBackendTestMixin``), written here in our words against a real
etcd: what ``get_state`` / ``set_state`` return for absent, current, stale,
missing and foreign tokens, and that a corrupt state is torch's
``RendezvousStateError``. On top: what an etcd writer without the job secret
can put under the state key (a pickle gadget, a blob of another run or job,
a tampered or truncated one) is refused before torch unpickles anything.
"""

from __future__ import annotations

import os
import pickle
import secrets
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError

from resilient_chaos.etcd_testing import unique_run_id
from resilient.rendezvous import Etcd3RendezvousBackend, RendezvousStateCorrupt, create_etcd3_handler
from resilient.secret import MAGIC, JobSecret, JobSecretError

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60), pytest.mark.usefixtures("restore_share_env")]

SECRET = JobSecret(secrets.token_hex(32).encode())


@pytest.fixture
def client(etcd):
    with etcd.client(retry_timeout=timedelta(seconds=10)) as c:
        yield c


@pytest.fixture
def backend(client):
    b = Etcd3RendezvousBackend(client, unique_run_id(), lease_ttl=timedelta(seconds=10), secret=SECRET)
    yield b
    b.lease.close(revoke=True)


# ------------------------------------------------------------ torch's contract
def test_reading_back_what_was_written(backend):
    backend.set_state(b"x")
    state, token = backend.get_state()
    assert state == b"x" and token is not None


def test_nothing_written_reads_as_none(backend):
    assert backend.get_state() is None


def test_first_write_creates_the_state(backend):
    state, token, written = backend.set_state(b"x")
    assert (state, written) == (b"x", True) and token is not None


def test_a_write_with_the_current_token_replaces_the_state(backend):
    _, first, ok1 = backend.set_state(b"x")
    state, second, ok2 = backend.set_state(b"y", first)
    assert ok1 and ok2 and state == b"y" and second != first


def test_a_write_with_a_stale_token_gets_the_current_state(backend):
    _, old, _ = backend.set_state(b"x")
    now_state, now_token, _ = backend.set_state(b"y", old)
    assert backend.set_state(b"z", old) == (now_state, now_token, False)


def test_a_write_without_token_over_an_existing_state_gets_it(backend):
    state, token, _ = backend.set_state(b"x")
    assert backend.set_state(b"y") == (state, token, False)


def test_a_write_with_a_token_it_never_issued_gets_the_current_state(backend):
    state, token, _ = backend.set_state(b"x")
    assert backend.set_state(b"y", token="invalid") == (state, token, False)


# ------------------------------------------------------------ corrupt states
def _gadget(path: Path) -> bytes:
    """What an etcd writer would put there: a pickle whose load creates ``path``."""
    class Gadget:
        def __reduce__(self):
            return os.system, (f"touch {path}",)
    return pickle.dumps(Gadget())


def _corruptions(backend: Etcd3RendezvousBackend, tmp_path: Path) -> dict[str, bytes]:
    good = SECRET.seal(backend.PURPOSE, backend.key, b"torch state")
    flipped_payload = bytearray(good)
    flipped_payload[-1] ^= 1
    flipped_tag = bytearray(good)
    flipped_tag[len(MAGIC)] ^= 0x80
    other_job = JobSecret(secrets.token_hex(32).encode())
    return {
        "empty": b"",
        "garbage": b"\x00\xffnot a state",
        "raw pickle gadget": _gadget(tmp_path / "pwned"),
        "gadget behind our tag, no valid mac": MAGIC + b"\x00" * 32 + _gadget(tmp_path / "pwned"),
        "truncated": good[: len(good) - 3],
        "cut inside the tag": good[: len(MAGIC) + 10],
        "flipped payload bit": bytes(flipped_payload),
        "flipped tag bit": bytes(flipped_tag),
        "sealed with another job's secret": other_job.seal(backend.PURPOSE, backend.key, _gadget(tmp_path / "pwned")),
        "moved from another run's key": SECRET.seal(backend.PURPOSE, backend.key + "-other", b"torch state"),
        "sealed for another purpose": SECRET.seal("registry", backend.key, b"torch state"),
    }


@pytest.mark.parametrize("kind", ["empty", "garbage", "raw pickle gadget", "gadget behind our tag, no valid mac",
                                  "truncated", "cut inside the tag", "flipped payload bit", "flipped tag bit",
                                  "sealed with another job's secret", "moved from another run's key",
                                  "sealed for another purpose"])
def test_a_corrupt_state_is_torchs_state_error(backend, client, tmp_path, kind):
    client.put(backend.key, _corruptions(backend, tmp_path)[kind])
    with pytest.raises(RendezvousStateError) as info:
        backend.get_state()
    assert isinstance(info.value, RendezvousStateCorrupt)
    assert "fails authentication" in str(info.value) and SECRET.fingerprint in str(info.value)
    # a writer that loses the compare-and-swap is handed the current state: the same check applies
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"mine", token=None)
    assert not (tmp_path / "pwned").exists()


def test_what_etcd_holds_is_sealed_and_bound_to_the_key(backend, client):
    backend.set_state(b"torch state")
    raw = client.get(backend.key).value
    assert raw.startswith(MAGIC) and raw.endswith(b"torch state") and raw != b"torch state"
    assert SECRET.unseal(backend.PURPOSE, backend.key, raw) == b"torch state"


def test_a_node_with_another_secret_cannot_read_or_join(backend, client):
    backend.set_state(b"torch state")
    other = Etcd3RendezvousBackend(client, backend.run_id, lease=backend.lease,
                                   secret=JobSecret(secrets.token_hex(32).encode()))
    with pytest.raises(RendezvousStateCorrupt, match="another job secret"):
        other.get_state()


def test_a_backend_without_any_secret_is_refused_with_how_to_provide_one(client, monkeypatch):
    monkeypatch.delenv("RESILIENT_JOB_SECRET", raising=False)
    monkeypatch.delenv("RESILIENT_JOB_SECRET_FILE", raising=False)
    with pytest.raises(JobSecretError, match="RESILIENT_JOB_SECRET"):
        Etcd3RendezvousBackend(client, unique_run_id())


def test_torchs_handler_never_unpickles_a_planted_gadget(etcd, job_secret, tmp_path):
    """The whole path: torch's DynamicRendezvousHandler over our backend, with a gadget
    planted under the state key by a writer without the secret. The join fails with
    torch's state error; the gadget's file is never created."""
    run_id = unique_run_id()
    params = RendezvousParameters("etcd3", etcd.endpoint, run_id, 1, 1, join_timeout=10, last_call_timeout=0.2)
    handler = create_etcd3_handler(params)
    sentinel = tmp_path / "pwned"
    try:
        with etcd.client() as attacker:
            attacker.put(f"/resilient/rdzv/{run_id}/state", _gadget(sentinel))
        with pytest.raises(RendezvousStateError, match="fails authentication"):
            handler.next_rendezvous()
        assert not sentinel.exists()
    finally:
        handler.shutdown()
