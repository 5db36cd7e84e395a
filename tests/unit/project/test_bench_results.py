"""bench/run.py writes bench/RESULTS.md from the rows' results; what it must not lose."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _run_module():
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_render_keeps_the_hand_written_sections_where_they_were():
    run = _run_module()
    old = ("# Benchmark results\n\nintro\n\n## a: row A\n\nold a\n\n## tool: by hand\n\nkept text\n\n"
           "## b: row B\n\nold b\n\n## last: by hand too\n\nkept at the end\n")
    new = "# Benchmark results\n\nintro\n\n## a: row A\n\nnew a\n\n## b: row B\n\nnew b\n"
    out = run.keep_written(old, new)
    assert [l for l in out.splitlines() if l.startswith("## ")] == [
        "## a: row A", "## tool: by hand", "## b: row B", "## last: by hand too"]
    assert "new a" in out and "new b" in out and "old a" not in out
    assert "kept text" in out and "kept at the end" in out
    assert run.keep_written(out, new) == out   # a second render changes nothing


def test_a_tools_raw_data_beside_the_rows_is_no_row(tmp_path):
    """bench/etcd_members.py writes its numbers to bench/results/etcd_members.json; the render
    took it for a row and failed (KeyError: 'date') after every benchmark run."""
    run = _run_module()
    (tmp_path / "row.json").write_text(json.dumps({"status": "measured", "title": "t", "date": "d"}))
    (tmp_path / "tool.json").write_text(json.dumps({"1": {"x": 1}, "3": {"x": 2}}))
    assert set(run.load_all(tmp_path)) == {"row"}
    run.render(run.load_all(tmp_path))
