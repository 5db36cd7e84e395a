"""Whole-job restarts from the durable tier: bitwise resume on the same
layout, and resharding onto other layouts (dp and pipeline re-splits)."""

from __future__ import annotations

import pytest

from launchutil import REPO, Agent, digests, events, losses, run_launch, steps_done, tiny_overrides, wait_for

DEMO = REPO / "configs" / "demo.toml"
pytestmark = pytest.mark.slow


def test_killed_job_resumes_bitwise(corpus, tmp_path):
    steps = 10
    over = tiny_overrides(corpus, steps, **{"snapshot.durable_every": 2})
    ref = tmp_path / "ref"
    run_launch(DEMO, ref, over, nproc=2)

    run = tmp_path / "run"
    run.mkdir()
    agent = Agent(DEMO, run, over, "n0", nproc=2)
    try:
        wait_for(lambda: any(e["event"] == "commit" and e["step"] >= 4 for e in events(run, "commit")), 180,
                 "a durable version at step ≥ 4")
        agent.kill_node()  # kill -9 the whole job: agent, workers, embedded etcd
    finally:
        agent.close()
    killed_at = steps_done(run)
    assert killed_at < steps, "the job finished before it could be killed; the test proves nothing"
    run_launch(DEMO, run, over, nproc=2)
    restore = [e for e in events(run, "restore")]
    assert restore and restore[0]["step"] >= 4 and not restore[0]["resharded"]
    assert digests(run) == digests(ref)
    # every step after the restore point reproduces the reference loss exactly
    ref_loss = losses(ref)
    resumed = [e for e in events(run, "step") if e["rank"] == 0 and e["time"] > restore[0]["time"]]
    assert resumed and all(e["loss"] == ref_loss[e["step"]] for e in resumed)


@pytest.mark.timeout(900)
def test_restart_onto_other_layouts(corpus, tmp_path):
    """dp=2 → pp=2 → dp=1: each launch restores the previous one's last
    version, resharded; losses stay within rounding of an uninterrupted run."""
    over = lambda stop, **kw: tiny_overrides(corpus, 12, **{"snapshot.durable_every": 4, "train.stop_at": stop,
                                                              "parallel.microbatches": 2, **kw})
    ref = tmp_path / "ref"
    run_launch(DEMO, ref, over(12), nproc=2)
    run = tmp_path / "run"
    run_launch(DEMO, run, over(4), nproc=2)                                       # dp=2
    run_launch(DEMO, run, over(8, **{"parallel.pp": 2}), nproc=2)                 # pp=2: a pipeline split
    run_launch(DEMO, run, over(12), nproc=1)                                      # dp=1
    restores = events(run, "restore")
    assert [e["step"] for e in restores if e["rank"] == 0] == [4, 8]
    assert all(e["resharded"] for e in restores)
    got, want = losses(run), losses(ref)
    assert sorted(got) == list(range(1, 13))
    for step in range(5, 13):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
