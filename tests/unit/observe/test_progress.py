"""The live progress line shows the newest committed version per tier."""

from __future__ import annotations

import io

from resilient.progress import ProgressLine
from resilient.snapshot.nodestore import NodeStore


def test_line_every_n_steps_with_committed_tiers():
    out = io.StringIO()
    line = ProgressLine(total_steps=20, stream=out, every=10)
    assert not line.due(3) and line.due(10) and line.due(20)
    line.set("committed", "local 9 peer 9 durable 5")
    line.update(3, 2.0, 1000.0)  # not due: nothing printed
    line.update(10, 1.5, 1234.0)
    text = out.getvalue()
    assert text.count("\n") == 1
    assert "step 10/20" in text and "loss 1.5000" in text and "1,234 tok/s" in text
    assert "committed local 9 peer 9 durable 5" in text


def test_node_store_publishes_the_agents_commits_to_its_workers(tmp_path):
    store = NodeStore(tmp_path, "run-x", "n0")
    store.create()
    try:
        assert store.read_committed() == {}
        store.publish_committed({"local": 7, "peer": 6})
        # What a worker sees: another NodeStore object on the same path.
        assert NodeStore(tmp_path, "run-x", "n0").read_committed() == {"local": 7, "peer": 6}
        assert store.versions() == []  # the status file is not a version
    finally:
        store.remove()


def test_a_tier_that_falls_behind_is_shown_stale():
    """The local tier stuck at step 40 (a node store that filled up) while training reached
    step 60: marked stale; a tier one interval behind (asynchronous commits) is not."""
    from resilient.job.job import committed_text
    from resilient.snapshot.config import SnapshotConfig

    snap = SnapshotConfig(every=1, durable_every=10)
    assert committed_text(60, {"local": 40, "peer": 59, "durable": 50}, snap) == "local 40 (stale) peer 59 durable 50"
    assert committed_text(60, {"local": 60, "durable": 38}, snap) == "local 60 durable 38 (stale)"
    assert committed_text(5, {}, snap) == "none yet"
