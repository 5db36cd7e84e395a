"""`resilient chaos run|report` refuse bad input with exit 2 before starting anything,
and `report` never calls an unfinished or empty campaign a pass."""

from __future__ import annotations

import json

import pytest

from resilient_chaos.runner import main

EVENT = json.dumps({"time": 1.0, "event": "step", "node": "a", "rank": 0, "step": 1, "loss": 5.0}) + "\n"


def test_report_on_an_empty_directory_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no events found" in capsys.readouterr().err


def test_report_on_a_campaign_stopped_before_its_faulted_run_is_an_error(tmp_path, capsys):
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "events.jsonl").write_text(EVENT)
    assert main(["report", str(tmp_path)]) == 2
    assert "only the reference run" in capsys.readouterr().err


def test_report_without_results_is_never_a_pass(tmp_path):
    (tmp_path / "faulted").mkdir()
    (tmp_path / "faulted" / "events.jsonl").write_text(EVENT)
    assert main(["report", str(tmp_path)]) == 1
    assert "campaign_finished" in (tmp_path / "faulted" / "report.md").read_text()


@pytest.mark.parametrize("body", ['{"scenario": {"name": "x"}, "properties": [{"na', "[1, 2]"])
def test_report_with_broken_results_is_an_error(tmp_path, capsys, body):
    (tmp_path / "events.jsonl").write_text(EVENT)
    (tmp_path / "results.json").write_text(body)
    assert main(["report", str(tmp_path)]) == 2
    assert "results.json is unreadable" in capsys.readouterr().err


def test_bad_run_arguments_start_nothing(tmp_path, capsys):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "latin.toml").write_bytes(b"\xff\xfe name = 1")
    (tmp_path / "inf.toml").write_text('name = "x"\nbudget_seconds = inf\n')
    (tmp_path / "afile").write_text("x")
    cases = [(["run", "kill-worker", "--budget", "nan"], "--budget must be > 0"),
             (["run", "kill-worker", "--budget", "1e20"], "--budget must be > 0"),
             (["run", str(tmp_path / "dir.toml")], "dir.toml is a directory"),
             (["run", str(tmp_path / "latin.toml")], "not UTF-8"),
             (["run", str(tmp_path / "inf.toml")], "must be a finite number"),
             (["run", "kill-worker", "--out", str(tmp_path / "afile")], "afile"),
             (["run", "kill-worker", "--out", str(tmp_path / "afile" / "sub")], "cannot use --out")]
    for argv, words in cases:
        assert main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dir.toml", "inf.toml", "latin.toml"]
