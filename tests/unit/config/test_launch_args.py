"""`resilient launch` refuses bad arguments before it starts or deletes anything."""

from __future__ import annotations

import errno

import pytest

from launchutil import REPO
from resilient.cli import main
from resilient.snapshot.api import StorageError
from resilient.snapshot.storage import RetryPolicy, with_retry

DEMO = str(REPO / "configs" / "demo.toml")


@pytest.mark.parametrize("flag,value", [("--node-id", ".."), ("--node-id", "a/b"), ("--node-id", ".hidden"),
                                        ("--run-id", "../other")])
def test_a_node_or_run_id_that_would_name_a_path_is_refused(tmp_path, capsys, flag, value):
    """The ids name the node store's directory, which is removed with rmtree: '..' there
    used to wipe the whole store dir (/dev/shm by default)."""
    store = tmp_path / "store"
    (store / "other-app").mkdir(parents=True)
    rc = main(["launch", DEMO, "--run-dir", str(tmp_path / "run"), flag, value,
               "--set", f"snapshot.store_dir={str(store)!r}".replace("'", '"')])
    assert rc == 2
    assert f"{flag} {value!r} is not a valid name" in capsys.readouterr().err
    assert (store / "other-app").is_dir() and not (tmp_path / "run").exists()


def test_a_negative_process_count_is_refused(tmp_path, capsys):
    assert main(["launch", DEMO, "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "-1"]) == 2
    assert "--nproc-per-node must be ≥ 1" in capsys.readouterr().err


def test_a_run_dir_that_cannot_be_made_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["launch", DEMO, "--run-dir", str(blocker / "run")]) == 2
    assert "cannot use run dir" in capsys.readouterr().err


@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only"),
                                        (errno.ENOTDIR, "a file stands where a directory")])
def test_errors_a_retry_cannot_mend_fail_at_once(code, words):
    calls = []

    def write():
        calls.append(1)
        raise OSError(code, "injected")

    with pytest.raises(StorageError, match=words):
        with_retry(write, "obj", RetryPolicy())
    assert len(calls) == 1


def test_transient_errors_are_still_retried():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EIO, "injected")
        return "ok"

    assert with_retry(flaky, "obj", RetryPolicy()) == "ok" and len(calls) == 3


def test_a_missing_corpus_is_refused_before_anything_starts(tmp_path, capsys):
    rc = main(["launch", DEMO, "--run-dir", str(tmp_path / "run"), "--set", f'data.path="{tmp_path / "none"}"',
               "--set", 'data.source=""'])
    assert rc == 2
    assert "no corpus at" in capsys.readouterr().err
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no agent, no etcd, no worker ran
