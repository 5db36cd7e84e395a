"""stall: training time blocked per snapshot, resilient vs the anchors (issue 4).

Why this row: a snapshot every step is only affordable if the training thread
pays no more than a memory copy. On the same fp32 state, alternating:

- memcpy floor: ``copy_`` of every tensor into a reused, pre-faulted buffer;
- resilient: ``Snapshotter.save`` after ``prepare`` and a warm-up save (the
  upload to file:// runs in the background; we wait for it between repeats, off
  the clock, so every trial starts from an idle disk);
- DCP ``async_save``, thread mode (it stages a copy synchronously);
- DCP ``async_save`` with its async stager (``DefaultStager``): the call returns
  at once, but the state must not change until staging ends, so both the
  return time and the time to ``staging_completion`` are reported; the ratio
  uses the latter (what a step that mutates parameters right away waits);
- ``torch.save`` to local disk (synchronous; page cache, no fsync).

DCP runs single-process with ``no_dist=True`` (no process group needed).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

from common import GB, Timer, alternate, drop_dir, fig, goal, make_state, ratio, row, state_bytes


def _trials(state: dict, root: Path) -> tuple[dict, callable]:
    import torch
    from torch.distributed.checkpoint import state_dict_saver as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from resilient.snapshot import Snapshotter

    bufs = {k: torch.empty_like(v) for k, v in state.items()}
    for b in bufs.values():
        b.zero_()  # fault the pages in, as a reused buffer would be
    snap = Snapshotter(f"file://{root}/resilient", every=1, keep_last=1)
    snap.prepare(state)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=False))
    step = [0]
    n = [0]

    def memcpy() -> float:
        with Timer() as t:
            for k, v in state.items():
                bufs[k].copy_(v)
        return t.s

    def resilient() -> float:
        step[0] += 1
        with Timer() as t:
            snap.save(step[0], state)
        snap.wait()
        return t.s

    def dcp_thread() -> float:
        n[0] += 1
        with Timer() as t:
            fut = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{n[0]}"), no_dist=True)
        fut.result()
        drop_dir(root / f"dcp-{n[0]}")
        return t.s

    def dcp_stager() -> dict:
        n[0] += 1
        t0 = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{n[0]}"), no_dist=True, async_stager=stager)
        returned = time.perf_counter() - t0
        resp.staging_completion.result()
        staged = time.perf_counter() - t0
        resp.upload_completion.result()
        drop_dir(root / f"dcp-{n[0]}")
        return {"returned": returned, "staged": staged}

    def torch_save() -> float:
        with Timer() as t:
            torch.save(state, root / "torch.pt")
        (root / "torch.pt").unlink()
        return t.s

    def close() -> None:
        snap.close()
        stager.close()

    return {"memcpy": memcpy, "resilient": resilient, "dcp_thread": dcp_thread,
            "dcp_stager": dcp_stager, "torch_save": torch_save}, close


def measure(size_gb: float, repeats: int) -> tuple[dict, dict]:
    state = make_state(int(size_gb * GB))
    tag = f"{size_gb:g}GB"
    root = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    trials, close = _trials(state, root)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = alternate(trials, repeats)
    finally:
        close()
        drop_dir(root)
    gbs = state_bytes(state) / GB
    figures = {
        f"memcpy_{tag}": fig(got["memcpy"], "s", f"memcpy {tag}"),
        f"resilient_{tag}": fig(got["resilient"], "s", f"resilient save {tag}"),
        f"dcp_thread_{tag}": fig(got["dcp_thread"], "s", f"DCP async_save thread {tag}"),
        f"dcp_stager_return_{tag}": fig([d["returned"] for d in got["dcp_stager"]], "s", f"DCP+stager returns {tag}"),
        f"dcp_stager_staged_{tag}": fig([d["staged"] for d in got["dcp_stager"]], "s", f"DCP+stager staged {tag}"),
        f"torch_save_{tag}": fig(got["torch_save"], "s", f"torch.save {tag}"),
    }
    res = figures[f"resilient_{tag}"]
    ratios = {
        f"resilient_vs_memcpy_{tag}": ratio(res, figures[f"memcpy_{tag}"], f"resilient / memcpy floor, {tag}"),
        f"resilient_vs_dcp_thread_{tag}": ratio(res, figures[f"dcp_thread_{tag}"], f"resilient / DCP async_save (thread), {tag}"),
        f"resilient_vs_dcp_stager_{tag}": ratio(res, figures[f"dcp_stager_staged_{tag}"], f"resilient / DCP async stager (until staged), {tag}"),
        f"resilient_vs_torch_save_{tag}": ratio(res, figures[f"torch_save_{tag}"], f"resilient / torch.save, {tag}"),
    }
    ratios[f"resilient_vs_memcpy_{tag}"]["label"] += f" ({gbs:.2f} GiB of fp32)"
    return figures, ratios


def run(quick: bool) -> dict:
    sizes = [0.0625] if quick else [0.25, 1.0]  # quick: 64 MiB, a smoke test of the same trials
    repeats = 3 if quick else 5
    figures, ratios, goals = {}, {}, []
    for s in sizes:
        f, r = measure(s, repeats)
        figures.update(f)
        ratios.update(r)
    for s in sizes:
        r = ratios[f"resilient_vs_memcpy_{s:g}GB"]["value"]
        goals.append(goal(f"blocked time within 1.2x of the memcpy floor ({s:g} GB)", r is not None and r <= 1.2,
                          f"{r}x of memcpy" + ("" if r is not None and r <= 1.2 else f": {r / 1.2:.2f}x over the goal" if r else "")))
    notes = [f"{repeats} alternating repeats after a discarded warm-up round; fp32 tensors of 32 MB each.",
             "The floor and our capture are both per-tensor `copy_` into reused buffers: a ratio below 1 is "
             "noise (page/cache state), i.e. at the floor.",
             "The 4 GB size of issue 9 is left out: 2 cores / 23 GB RAM shared with other engineers "
             "(the trials hold ~5 copies of the state at once).",
             "DCP+stager 'returns' is the call's own time; 'staged' is when the state may be modified again. "
             "A loop that overlaps forward/backward with staging pays between the two."]
    return row("Snapshot stall: training time blocked per snapshot", figures, ratios, goals, notes)
