"""A state dict passed again and again (the training loop's fast path) is captured fresh each time.

The Snapshotter and the capture cache their plan and copy lists while the
state is made of the same tensor objects; these tests make sure the cache
never serves stale bytes: values changed in place are seen, and tensors
replaced by new objects (a restore, a new optimizer state) are seen too.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from resilient.snapshot import SnapshotReader, Snapshotter


def read_back(url: str, like: dict) -> dict:
    out = {"w": torch.zeros_like(like["w"]), "b": torch.zeros_like(like["b"]), "n": 0}
    from resilient.snapshot.restore import restore_state

    restore_state(SnapshotReader(url), out, rank=0, config_digest="t")
    return out


def test_in_place_updates_are_captured_by_the_reused_plan(tmp_path):
    url = f"file://{tmp_path}/ck"
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)[1:4], "n": 0}
    with Snapshotter(url, every=1, config_digest="t", keep_last=10) as snap:
        for step in range(1, 4):
            state["w"].mul_(2).add_(step)
            state["b"].add_(step)
            state["n"] = step
            snap.save(step, state)
            snap.wait(timedelta(seconds=30))
            got = read_back(url, state)
            assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
            assert got["n"] == step


def test_replaced_tensors_are_captured_not_the_old_ones(tmp_path):
    url = f"file://{tmp_path}/ck"
    state = {"w": torch.zeros(3, 4), "b": torch.zeros(3), "n": 1}
    with Snapshotter(url, every=1, config_digest="t", keep_last=10) as snap:
        snap.save(1, state)
        snap.wait(timedelta(seconds=30))
        old_w = state["w"]
        state["w"] = torch.full((3, 4), 7.0)  # a new object of the same structure
        old_w.fill_(-1.0)  # the old one changing must not leak into the new version
        snap.save(2, state)
        snap.wait(timedelta(seconds=30))
        got = read_back(url, state)
        assert torch.equal(got["w"], torch.full((3, 4), 7.0))


def test_one_capture_feeds_two_tiers(tmp_path):
    """A RAM-store writer and a durable writer share buffers: one copy, two versions written."""
    state = {"w": torch.zeros(64, 8), "n": 0}
    ram = Snapshotter(f"file://{tmp_path}/ram", every=1, config_digest="t", keep_last=2)
    durable = Snapshotter(f"file://{tmp_path}/durable", every=3, config_digest="t", keep_last=10, share_with=ram)
    assert len(ram._ring._slots) == 3  # one per writer, plus one to capture into
    try:
        for step in range(1, 10):
            state["w"].fill_(step)
            state["n"] = step
            assert ram.save(step, state, also=(durable,) if durable.due(step) else ())
        assert ram.wait(timedelta(seconds=30)) and durable.wait(timedelta(seconds=30))
    finally:
        ram.close()
        durable.close()
    # Durable holds steps it was due at, or, when it fell behind the captures, a newer one
    # its pending version was coalesced into (it skips to the newest, never loses its turn:
    # on a loaded host step 5 can replace step 3). Never one before its first due step.
    steps = SnapshotReader(f"file://{tmp_path}/durable").complete_steps()
    assert steps and min(steps) >= 3 and steps[-1] == 9
    for url, got in ((f"file://{tmp_path}/durable", steps), (f"file://{tmp_path}/ram", [9])):
        r = SnapshotReader(url)
        for step in got:  # every version is whole and of its own step
            m = r.manifest(step)
            assert torch.equal(r.read_region(m, "w"), torch.full((64, 8), float(step)))
            assert m.values["n"] == step


def test_sharing_needs_share_with(tmp_path):
    a = Snapshotter(f"file://{tmp_path}/a", every=1)
    b = Snapshotter(f"file://{tmp_path}/b", every=1)
    try:
        with pytest.raises(ValueError, match="share_with"):
            a.save(1, {"w": torch.zeros(2)}, also=(b,))
        with pytest.raises(ValueError, match="different URLs"):
            Snapshotter(f"file://{tmp_path}/a", every=1, share_with=a)
    finally:
        a.close()
        b.close()


def test_buffers_prepared_in_the_background_are_waited_for(monkeypatch):
    """preallocate(background=True): the first buffer (a restore's staging) now, the others on
    a thread; a capture that finds every other slot still being prepared waits for one."""
    import threading

    from resilient.snapshot import capture

    gate = threading.Event()
    real = capture.SlotRing._allocate

    def slow(slot, plan, pin):  # the background allocations wait for the test's go
        if threading.current_thread().name == "snapshot-prepare":
            assert gate.wait(30)
        real(slot, plan, pin)

    monkeypatch.setattr(capture.SlotRing, "_allocate", staticmethod(slow))
    tensors = {"w": torch.arange(12.0).reshape(3, 4)}
    plan = capture.build_plan(tensors, None, 1 << 20, 1 << 20)
    ring = capture.SlotRing(2)
    ring.preallocate(plan, pin=False, background=True)
    assert [s.state for s in ring._slots] == ["free", "preparing"]
    assert ring.staging() is not None
    first, skipped = ring.acquire(plan, pin=False)  # the ready slot
    ring.publish(first, {"x"})
    assert ring.take("x", timedelta(seconds=1)) is first  # a writer is busy with it
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(plan, pin=False)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got, "the capture must wait for the slot being prepared"
    gate.set()
    waiter.join(30)
    (second, skipped), = got
    assert second is not first and skipped is None and second.buffer.numel() >= plan.total_bytes
