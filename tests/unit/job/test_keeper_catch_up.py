"""After a restore from a memory tier, the durable version due at that step is written when
the lost run had not uploaded it (issue 28, item 4: no gap in the durable history).
``StateKeeper.catch_up`` against a real durable tier (file://), one process."""

from __future__ import annotations

import torch

from resilient.events import EventLog, read_events
from resilient.snapshot.keeper import StateKeeper
from resilient.snapshot.config import SnapshotConfig


def keeper(run_dir, state):
    cfg = SnapshotConfig(every=1, durable_every=5, memory=False)
    return StateKeeper(cfg, run_dir, lambda: state, lambda s: None, EventLog(run_dir / "events.jsonl", node="n", rank=0),
                       layout={"world": 1})


def durable_commits(run_dir):
    return [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "commit" and e["tier"] == "durable"]


def test_the_durable_version_due_at_the_restored_step_is_written_once(tmp_path):
    state = {"w": torch.arange(12, dtype=torch.float32), "step": 0}
    k = keeper(tmp_path, state)
    try:
        # the lost run had made step 5 durable; it died after step 10 reached node RAM only
        state["step"] = 5
        k.after_step(5, lambda: {}, lambda: {})
        k.wait_idle()
        k.durable_step = 5
        # restored at 10 from a memory tier (due for the durable tier, never uploaded): written
        state["step"] = 10
        assert k.catch_up(10, lambda: {}, lambda: {}) is True
        k.wait_idle()
        assert k.durable.committed_step == 10 and durable_commits(tmp_path) == [5, 10]
        # a second restore at 10 does not write it again; a step not due is not written
        assert k.catch_up(10, lambda: {}, lambda: {}) is False
        assert k.catch_up(12, lambda: {}, lambda: {}) is False
        k.wait_idle()
        assert durable_commits(tmp_path) == [5, 10]
    finally:
        k.close()
    # the caught-up version is the state at 10, readable as any other
    back = {"w": torch.zeros(12), "step": 0}
    k2 = keeper(tmp_path, back)
    try:
        restored = k2.restore()
        assert restored is not None and restored.step == 10
        assert torch.equal(back["w"], torch.arange(12, dtype=torch.float32)) and back["step"] == 10
    finally:
        k2.close()
