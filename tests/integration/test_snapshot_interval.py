"""``snapshot.every = "auto"`` (issue 25, item 4): the Young/Daly chooser as a pure function
(an injected failure rate, a slowed link), its monotonicity under hypothesis, the config's
errors, and a Job whose durable interval is auto: versions at the announced intervals, a crash
restored, the restart counted as a failure."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from resilient.errors import ConfigError
from resilient.events import read_events
from resilient.job import Job, NotUnderAgent
from resilient.runconfig import load_runtime_config, runtime_config_from_dict
from resilient.snapshot.config import SnapshotConfig
from resilient.snapshot.interval import Limits, Measured, choose, mtbf_s

HOUR = 3600.0
WIDE = Limits(prior_mtbf_s=24 * HOUR, budget=0.1, lo=1, hi=100_000)


def young_daly(cost_s: float, mtbf: float, step_s: float) -> float:
    return math.sqrt(2 * cost_s * mtbf) / step_s


def test_the_interval_follows_young_daly_as_failures_come():
    """0.5 s steps, a version blocking 0.2 s: with no failure seen the prior rules; an injected
    failure rate (10 failures in 10 h) pulls the MTBF to (24 + 10) h / 11 ≈ 3.1 h, the interval
    by √(24 / 3.1)."""
    calm = choose(Measured(step_s=0.5, cost_s=0.2), WIDE)
    assert calm.bound == "young_daly" and calm.mtbf_s == 24 * HOUR
    assert calm.every == round(young_daly(0.2, 24 * HOUR, 0.5)) == 372
    stormy = choose(Measured(step_s=0.5, cost_s=0.2, failures=10, seconds=10 * HOUR), WIDE)
    assert stormy.mtbf_s == pytest.approx((24 + 10) * HOUR / 11)
    assert stormy.every == round(young_daly(0.2, stormy.mtbf_s, 0.5)) == 133
    # A job that fails all the time converges to T / F whatever the prior.
    assert mtbf_s(24 * HOUR, 10_000, 1_000 * HOUR) == pytest.approx(1_000 * HOUR / 10_000, rel=0.03)


def test_a_slowed_link_widens_the_interval_to_its_budget():
    """1 GB versions, 0.1 s steps, 10% of the link: at 10 GB/s Young/Daly rules; the link
    slowed to 100 MB/s needs ≥ 1 GB / (100 MB/s · 0.1 · 0.1 s) = 1000 steps between versions."""
    fast = choose(Measured(step_s=0.1, cost_s=0.05, bytes=1e9, link_bytes_s=10e9), WIDE)
    assert fast.bound == "young_daly" and fast.every == round(young_daly(0.05, 24 * HOUR, 0.1))
    slow = choose(Measured(step_s=0.1, cost_s=0.05, bytes=1e9, link_bytes_s=100e6), WIDE)
    assert slow.bound == "budget" and slow.budget_floor == pytest.approx(1000) and slow.every == 1000
    # a higher measured cost moves Young/Daly the same way
    costly = choose(Measured(step_s=0.1, cost_s=5.0, bytes=1e9, link_bytes_s=10e9), WIDE)
    assert costly.every == round(young_daly(5.0, 24 * HOUR, 0.1)) > fast.every


def test_bounds_and_an_unmeasured_job():
    tight = Limits(prior_mtbf_s=24 * HOUR, budget=0.1, lo=5, hi=50)
    assert choose(Measured(step_s=1.0, cost_s=1e-9), tight).every == 5
    assert choose(Measured(step_s=1.0, cost_s=1e-9), tight).bound == "min"
    assert choose(Measured(step_s=1e-3, cost_s=10.0), tight).bound == "max"
    assert choose(Measured(step_s=1e-3, cost_s=10.0), tight).every == 50
    assert choose(Measured(step_s=0.0, cost_s=1.0), tight).bound == "unmeasured"


positive = st.floats(min_value=1e-4, max_value=1e4, allow_nan=False, allow_infinity=False)
measured = st.builds(Measured, step_s=positive, cost_s=positive, bytes=st.floats(0, 1e12),
                     link_bytes_s=st.just(0.0) | st.floats(1.0, 1e11), failures=st.integers(0, 10_000),
                     seconds=st.floats(0, 1e8))
limits = st.builds(lambda lo, span, budget, prior: Limits(prior, budget, lo, lo + span),
                   st.integers(1, 100), st.integers(0, 10_000), st.floats(0.01, 1.0), positive)


def grown(m: Measured, field: str, factor: float) -> Measured:
    return Measured(**{**m.__dict__, field: type(getattr(m, field))(getattr(m, field) * factor)})


@settings(max_examples=300, deadline=None)
@given(measured, limits, st.floats(1.0, 100.0))
def test_monotone_and_bounded(m, lim, factor):
    """Within [lo, hi]; never closer apart when a version costs more, moves more bytes, the link
    slows or the budget shrinks; never further apart when failures come more often."""
    c = choose(m, lim)
    assert lim.lo <= c.every <= lim.hi
    assert choose(grown(m, "cost_s", factor), lim).every >= c.every
    assert choose(grown(m, "bytes", factor), lim).every >= c.every
    if m.link_bytes_s > 0:
        assert choose(grown(m, "link_bytes_s", 1 / factor), lim).every >= c.every
    assert choose(m, Limits(lim.prior_mtbf_s, lim.budget / factor, lim.lo, lim.hi)).every >= c.every
    more = Measured(**{**m.__dict__, "failures": m.failures + 1 + int(factor)})
    assert choose(more, lim).every <= c.every
    if c.bound == "young_daly":   # the unbounded choice is Young/Daly to the nearest step
        assert abs(c.every - young_daly(m.cost_s, c.mtbf_s, m.step_s)) <= 0.5 + 1e-9


def test_config_takes_auto_and_says_what_a_typo_is():
    assert runtime_config_from_dict({"snapshot": {"every": "auto", "durable_every": "AUTO"}}).snapshot.auto_tiers == (
        "memory", "durable")
    assert load_runtime_config(None, ["snapshot.every=auto"]).snapshot.every == "auto"
    fixed = SnapshotConfig()
    assert (fixed.every, fixed.durable_every, fixed.auto_tiers) == (1, 10, ())   # defaults unchanged
    with pytest.raises(ConfigError, match="did you mean 'auto'"):
        runtime_config_from_dict({"snapshot": {"every": "atuo"}})
    with pytest.raises(ConfigError, match="snapshot.durable_every.*number of steps"):
        SnapshotConfig(durable_every="often")
    with pytest.raises(ConfigError, match="auto_budget"):
        SnapshotConfig(auto_budget=0.0)
    with pytest.raises(ConfigError, match="auto_min_steps"):
        SnapshotConfig(auto_min_steps=10, auto_max_steps=5)


class Crash(Exception):
    pass


def train(run_dir, steps: int, crash_at: int | None = None):
    """A small loop with ``durable_every = "auto"`` bounded to 3..6 steps, so that whatever the
    host measures the versions land well inside the run."""
    cfg = load_runtime_config(None, ["snapshot.durable_every=auto", "snapshot.auto_min_steps=3",
                                     "snapshot.auto_max_steps=6", "sdc.enable=false"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotUnderAgent)
        job = Job(model, opt, run_dir=run_dir, config=cfg, progress=False)
    failed = True
    try:
        for step in job.steps(steps):
            if step == crash_at:
                raise Crash(step)
            model(torch.full((2, 4), float(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        failed = False
    finally:
        job.close(failed=failed)
    return job, model


def captures(log) -> list[int]:
    return [e["step"] for e in log if e["event"] == "snapshot"]


def test_a_job_with_an_auto_durable_interval_keeps_to_it_and_restores(tmp_path):
    with pytest.raises(Crash):
        train(tmp_path, 40, crash_at=30)
    log = list(read_events(tmp_path / "events.jsonl"))
    chosen = [e for e in log if e["event"] == "snapshot_interval"]
    assert chosen and chosen[0]["tier"] == "durable" and chosen[0]["failures"] == 0
    assert {"young_daly", "budget_floor", "mtbf_s", "cost_s", "step_s", "bound", "link_mb_s"} <= set(chosen[0])
    # Each version lies the interval in force after its predecessor: the first one 3 (the
    # minimum) after the start; a choice applies from the version it was made at.
    every, expect, carried = 3, 0, {}
    changes = {e["step"]: e["every"] for e in chosen}
    for step in captures(log):
        assert step == expect + every, (captures(log), changes)
        carried[step] = every      # the version's global state holds the interval it was taken at
        every, expect = changes.get(step, every), step
    # (A version whose upload a newer capture overtook is coalesced away: commits are a subset.)
    commits = [e["step"] for e in log if e["event"] == "commit" and e["tier"] == "durable"]
    assert len(captures(log)) >= 4 and commits and set(commits) <= set(captures(log))
    # The restart restores the newest version, counts the crash as a failure, and takes the
    # next version the carried interval after it.
    job, model = train(tmp_path, 40)
    restored = job.restored.step
    assert restored == commits[-1]
    after = list(read_events(tmp_path / "events.jsonl"))[len(log):]
    assert [e["failures"] for e in after if e["event"] == "snapshot_interval"][:1] == [1]
    assert job.keeper.auto.failures == 1
    assert captures(after)[0] == restored + carried[restored] or restored + carried[restored] > 40
    assert job.step == 40 and job.committed()["durable"] == 40


def agree_worker(rank: int, world: int, store: str, run_dir: str) -> None:
    """Each rank measures something else (rank 1 a slower step, a costlier capture and a slower
    link; rank 0 more failures): after the choice both take the same interval, from the
    slowest step, the costliest version, the slowest link and the most failures."""
    import time

    import torch.distributed as dist

    from resilient.events import EventLog
    from resilient.snapshot.interval import AutoSchedule, schedule_group
    from spawnutil import exit_passed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    cfg = SnapshotConfig(durable_every="auto", auto_min_steps=1, auto_max_steps=10**9, auto_mtbf_hours=1.0)
    auto = AutoSchedule(cfg, ("durable",), EventLog(Path(run_dir) / "events.jsonl", node="n", rank=rank), rank,
                        schedule_group(cfg, world))
    auto.failures = 2 if rank == 0 else 0
    for _ in range(3):
        auto.step_ended()
        time.sleep(0.03 if rank == 1 else 0.001)
    auto.step_ended()
    auto.captured(3, ("durable",), 0.5 if rank == 1 else 0.01)
    auto.link("durable", 1e6, 1.0 if rank == 1 else 0.01)   # 1 MB/s on rank 1, 100 MB/s on rank 0
    assert auto.maybe_choose(3)
    got = [None] * world
    dist.all_gather_object(got, auto.every("durable"))
    assert got[0] == got[1], got
    exit_passed()


@pytest.mark.slow
def test_every_rank_takes_the_same_interval_from_agreed_inputs(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(agree_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    (e,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot_interval"]
    assert e["rank"] == 0 and e["failures"] == 2 and e["cost_s"] == 0.5 and e["link_mb_s"] == 1.0
    assert e["step_s"] >= 0.03
    # the choice from those inputs (the event rounds step_s to the microsecond)
    lim = Limits(3600.0, 0.1, 1, 10**9)
    lo, hi = (choose(Measured(e["step_s"] * f, 0.5, 1e6, 1e6, 2, e["seconds"]), lim).every for f in (1.001, 0.999))
    assert lo <= e["every"] <= hi
