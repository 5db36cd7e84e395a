"""The job secret comes from outside etcd: a 0600 file, the environment, or the run dir
(created once, atomically, by whichever agent comes first); a file other users can read
is refused, and a process without a secret is told how to provide one."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

from resilient.secret import (
    RUN_DIR_SECRET,
    SECRET_ENV,
    SECRET_FILE_ENV,
    JobSecret,
    JobSecretError,
    Unauthentic,
    provide_job_secret,
    require_secret,
    resolve_secret,
)

VALUE = "f" * 64


@pytest.fixture
def no_secret_env(monkeypatch):
    # setenv first: it records the original state (absent included), so what provide_job_secret
    # writes into os.environ is undone after the test instead of leaking into later agents
    for key in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def _file(path, text: str = VALUE, mode: int = 0o600):
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return path


def test_where_the_secret_comes_from_first_found_wins(tmp_path, no_secret_env, monkeypatch):
    assert resolve_secret() is None
    monkeypatch.setenv(SECRET_ENV, "e" * 40)
    assert resolve_secret().material == b"e" * 40
    monkeypatch.setenv(SECRET_FILE_ENV, str(_file(tmp_path / "env.secret", "d" * 40)))
    assert resolve_secret().material == b"d" * 40
    assert resolve_secret(_file(tmp_path / "given.secret")).material == VALUE.encode()


@pytest.mark.parametrize("mode,ok", [(0o600, True), (0o400, True), (0o640, True), (0o440, True),
                                     (0o644, False), (0o604, False), (0o660, False), (0o666, False)])
def test_a_file_others_can_read_or_its_group_can_write_is_refused(tmp_path, mode, ok):
    path = _file(tmp_path / "s", mode=mode)
    if ok:
        assert resolve_secret(path).material == VALUE.encode()
    else:
        with pytest.raises(JobSecretError, match=r"chmod 600"):
            resolve_secret(path)


@pytest.mark.parametrize("bad,match", [("short", "fewer than 32"), (None, "does not exist")])
def test_a_short_or_missing_secret_is_refused_with_how_to_make_one(tmp_path, bad, match):
    path = tmp_path / "s"
    if bad is not None:
        _file(path, bad)
    with pytest.raises(JobSecretError, match=match) as info:
        resolve_secret(path)
    assert "secrets.token_hex(32)" in str(info.value) or "does not exist" in str(info.value)


def test_no_secret_anywhere_is_a_clear_error(no_secret_env):
    with pytest.raises(JobSecretError, match=f"{SECRET_FILE_ENV}.*{SECRET_ENV}"):
        require_secret(what="this test")


def test_the_run_dir_secret_is_created_once_by_concurrent_agents(tmp_path, no_secret_env):
    """Six processes start on one run dir at once: one secret, mode 0600, no leftovers."""
    code = ("import sys; from resilient.secret import provide_job_secret; "
            "print(provide_job_secret(sys.argv[1]).material.decode())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    try:
        seen = {p.communicate(timeout=timedelta(seconds=60).total_seconds())[0].strip() for p in procs}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    path = tmp_path / RUN_DIR_SECRET
    assert len(seen) == 1 and seen == {path.read_text().strip()} and len(seen.pop()) == 64
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_DIR_SECRET]


def test_launch_names_the_secret_in_the_environment(tmp_path, no_secret_env):
    got = provide_job_secret(tmp_path)
    assert os.environ[SECRET_FILE_ENV] == str((tmp_path / RUN_DIR_SECRET).resolve())
    assert require_secret().material == got.material  # what the rendezvous, registry and workers read
    given = _file(tmp_path / "given", "g" * 40)
    other = tmp_path / "other-run"
    other.mkdir()
    assert provide_job_secret(other, given).material == b"g" * 40
    assert not (other / RUN_DIR_SECRET).exists()  # a given secret: nothing created
    assert os.environ[SECRET_FILE_ENV] == str(given)


def test_a_world_readable_run_dir_secret_is_refused(tmp_path, no_secret_env):
    _file(tmp_path / RUN_DIR_SECRET, mode=0o644)
    with pytest.raises(JobSecretError, match="other users can read"):
        provide_job_secret(tmp_path)


def test_records_are_bound_to_their_key_and_purpose():
    s = JobSecret(VALUE.encode())
    raw = s.seal_record("commit", "/r/commit/1", {"step": 1, "time": 1.5, "holders": {"0": ["a"]}})
    assert s.open_record("commit", "/r/commit/1", raw) == {"step": 1, "time": 1.5, "holders": {"0": ["a"]}}
    for purpose, key, blob in [("commit", "/r/commit/2", raw), ("holds", "/r/commit/1", raw),
                               ("commit", "/r/commit/1", raw.replace('"step": 1', '"step": 9')),
                               ("commit", "/r/commit/1", '{"step": 1}'), ("commit", "/r/commit/1", "not json")]:
        with pytest.raises(Unauthentic):
            s.open_record(purpose, key, blob)
    with pytest.raises(Unauthentic):
        JobSecret(b"x" * 32).open_record("commit", "/r/commit/1", raw)
    assert s.fingerprint != JobSecret(b"x" * 32).fingerprint and VALUE not in s.fingerprint
