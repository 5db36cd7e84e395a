"""A run dir is its user's alone (resilient/rundir.py): created 0700 and its files 0600 whatever the
umask; a run dir, or a file in it, that another user made or could change is refused with a typed
error that says what to do."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from resilient.events import EventLog
from resilient.launch import private_run_dir, write_content_addressed
from resilient.rundir import RunDirUnsafe, open_private, private_dir, write_private
from resilient.secret import RUN_DIR_SECRET, SECRET_ENV, SECRET_FILE_ENV, JobSecretError, provide_job_secret

NOBODY = 65534


@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.fixture
def no_secret_env(monkeypatch):
    for key in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_whatever_the_umask_the_run_dir_is_0700_and_its_files_0600(tmp_path, umask0, no_secret_env):
    run = tmp_path / "a" / "run"
    private_run_dir(run, "")
    write_content_addressed(run, "runtime", "{}")
    EventLog(run / "events.jsonl", node="n").close()
    provide_job_secret(run)
    assert {p.name: mode(p) for p in [tmp_path / "a", run, *run.iterdir()]} == {
        "a": 0o700, "run": 0o700, "checkpoints": 0o700, "events.jsonl": 0o600, "job.secret": 0o600,
        "runtime.json": 0o600, f"runtime-{sorted(run.glob('runtime-*'))[0].name[8:]}": 0o600}


def test_what_an_older_version_left_wide_is_narrowed(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    (run / "checkpoints").mkdir(mode=0o755)
    (run / "events.jsonl").write_text("")
    os.chmod(run / "events.jsonl", 0o644)
    private_run_dir(run, "")
    EventLog(run / "events.jsonl", node="n").close()
    assert mode(run) == 0o755   # a run dir a user chose keeps its mode: what the job puts in it is private
    assert (mode(run / "checkpoints"), mode(run / "events.jsonl")) == (0o700, 0o600)
    # a durable tier given in the run dir is the job's too; one elsewhere is left as it is
    private_run_dir(run, (run / "ckpt").as_uri())
    assert mode(run / "ckpt") == 0o700
    private_run_dir(run, "s3://bucket/ckpt")


@pytest.mark.parametrize("how", ["group_writable", "world_writable", "link", "not_a_dir"])
def test_a_run_dir_others_could_have_set_up_is_refused_with_the_fix(tmp_path, how):
    run = tmp_path / "run"
    if how == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        run.symlink_to(tmp_path / "elsewhere")
    elif how == "not_a_dir":
        run.write_text("")
    else:
        run.mkdir()
        os.chmod(run, 0o770 if how == "group_writable" else 0o777)
    fix = {"group_writable": "chmod 700", "world_writable": "chmod 700", "link": "symbolic link",
           "not_a_dir": "not a directory"}[how]
    with pytest.raises(RunDirUnsafe, match=fix):
        private_dir(run)
    assert isinstance(RunDirUnsafe("x"), PermissionError)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_run_dir_or_a_file_another_user_owns_is_refused(tmp_path, no_secret_env):
    run = tmp_path / "theirs"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    with pytest.raises(RunDirUnsafe, match=r"owned by .*not by you.*Use a run dir of your own"):
        private_dir(run)
    with pytest.raises(RunDirUnsafe):
        provide_job_secret(run)   # never adopted: its job.secret is not even looked at
    ours = tmp_path / "ours"
    private_dir(ours)
    (ours / "events.jsonl").write_text("")
    os.chown(ours / "events.jsonl", NOBODY, NOBODY)
    with pytest.raises(RunDirUnsafe, match="owned by"):
        EventLog(ours / "events.jsonl", node="n")
    write_private(ours / RUN_DIR_SECRET, "s" * 64)
    os.chown(ours / RUN_DIR_SECRET, NOBODY, NOBODY)
    with pytest.raises(JobSecretError, match=r"owned by .*remove .*job.secret"):
        provide_job_secret(ours)


def test_files_are_never_written_through_a_link(tmp_path, no_secret_env):
    run = private_dir(tmp_path / "run")
    target = tmp_path / "target"
    target.write_text("precious")
    for name in ("events.jsonl", RUN_DIR_SECRET):
        (run / name).symlink_to(target)
    with pytest.raises(RunDirUnsafe, match="symbolic link"):
        open_private(run / "events.jsonl")
    with pytest.raises(JobSecretError, match="symbolic link"):
        provide_job_secret(run)
    write_private(run / "runtime.json", "{}")   # replaces a link by a file, never writes through one
    (run / "config.json").symlink_to(target)
    write_content_addressed(run, "config", "{}")
    assert target.read_text() == "precious" and not (run / "config.json").is_symlink()


def test_a_parent_anyone_can_rename_in_is_refused_but_a_sticky_one_is_fine(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(RunDirUnsafe, match="no sticky bit"):
        private_dir(shared / "run")
    os.chmod(shared, 0o1777)
    assert mode(private_dir(shared / "run")) == 0o700


def test_launch_refuses_an_unsafe_run_dir_before_anything_starts(tmp_path, monkeypatch):
    from resilient.launch import prepare_run
    from resilient.launch_args import parse_args

    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    args: argparse.Namespace = parse_args(["--run-dir", str(run), "--nproc-per-node", "1", "train.py"])
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunDirUnsafe, match=f"{run}.*chmod 700"):
        prepare_run(args)
    assert list(run.iterdir()) == []
