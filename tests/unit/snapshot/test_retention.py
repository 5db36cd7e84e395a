"""Durable retention (resilient/snapshot/retention.py): what is kept, what a rollback drops."""

from __future__ import annotations

import fsspec
import torch

from resilient.snapshot import Snapshotter, SnapshotReader
from resilient.snapshot.retention import drop_after, plan_retention


def test_the_verified_floor_survives_keep_last():
    versions = {s: True for s in range(1, 8)}
    assert plan_retention(versions, keep_last=2, keep_every=0) == [1, 2, 3, 4, 5]
    # the SDC checks last verified step 4: a rollback goes back there
    assert plan_retention(versions, keep_last=2, keep_every=0, floor=4) == [1, 2, 3, 5]
    # between two versions: the newest at or below it
    assert plan_retention({1: True, 3: True, 5: True, 7: True}, keep_last=1, keep_every=0, floor=4) == [1, 5]
    # an incomplete version never stands for the floor
    assert plan_retention({2: True, 4: False, 6: True}, keep_last=1, keep_every=0, floor=4) == [4]


def test_drop_after_removes_the_abandoned_future(tmp_path):
    url = f"file://{tmp_path}/ck"
    with Snapshotter(url, keep_last=10) as snap:
        for step in range(1, 6):
            snap.save(step, {"w": torch.full((4,), float(step))})
            snap.wait()
    fs, root = fsspec.core.url_to_fs(url)
    assert drop_after(fs, root, 2) == [3, 4, 5]
    assert sorted(SnapshotReader(url).complete_steps()) == [1, 2]
    state = {"w": torch.zeros(4)}
    assert Snapshotter(url).restore(state).step == 2 and state["w"].eq(2.0).all()
