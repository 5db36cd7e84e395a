"""Matplotlib is the ``plot`` extra, which the README's install does not bring: without it a
chaos report and a benchmark row are written whole, only their pictures are skipped, and
the user is told once what to install (resilient.observe.plots)."""

from __future__ import annotations

import json
import sys

import pytest

from resilient.observe import plots

from launchutil import REPO  # noqa: E402


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` now raises ImportError
    monkeypatch.setattr(plots, "_told", False)


def test_pyplot_says_once_what_to_install(no_matplotlib, capsys):
    assert plots.pyplot() is None and plots.pyplot() is None
    err = capsys.readouterr().err
    assert err.count("matplotlib is not installed") == 1 and "resilient[plot]" in err


def test_a_chaos_report_is_written_without_its_picture(no_matplotlib, tmp_path):
    from test_chaos_properties import good_run

    from resilient_chaos.properties import check_timeline
    from resilient_chaos.report import report
    from resilient_chaos.timeline import episodes

    tl = good_run(tmp_path).timeline()
    props = check_timeline(tl, episodes(tl), steps=20)
    (tmp_path / "results.json").write_text(json.dumps({"scenario": {"name": "good"}, "injections": [],
                                                       "properties": [p.to_dict() for p in props]}))
    assert report(tmp_path) == 0
    md = (tmp_path / "report.md").read_text()
    assert "— PASS" in md and "timeline.png" not in md and not (tmp_path / "timeline.png").exists()


def test_a_benchmark_row_keeps_its_figures_without_its_picture(no_matplotlib, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from common import fig, plot_figures, row

    res = row("a row", {"t": fig([1.0, 2.0, 3.0], "s", "time")})
    assert plot_figures("t", res, tmp_path) == [] and not list(tmp_path.iterdir())
