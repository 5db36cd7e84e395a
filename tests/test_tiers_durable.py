"""Every node lost: nothing is left in RAM, so the next start restores from durable
storage; the kill -9 left a node store behind, which the next start reclaims, and
its clean exit leaves nothing in /dev/shm."""

from __future__ import annotations

import os

import pytest

from launchutil import REPO, Agent, events, steps_done, tiny_overrides, wait_for
from resilient.etcd.testing import embedded_etcd
from resilient.launch import default_run_id

DEMO = REPO / "configs" / "demo.toml"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # minutes on a loaded 2-core host


def test_all_nodes_killed_restore_from_durable_and_reclaim(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shm = "/dev/shm/resilient-" + default_run_id(run)
    over = tiny_overrides(corpus, 24, **{"snapshot.every": 1, "snapshot.durable_every": 4})
    with embedded_etcd() as etcd:
        first = Agent(DEMO, run, over, "n0", endpoint=etcd.endpoint, nproc=2)
        try:
            wait_for(lambda: [e for e in events(run, "commit") if e["tier"] == "durable"], 300, "a durable commit")
            wait_for(lambda: steps_done(run) >= 10, 300, "more steps")
        finally:
            first.kill_node()  # kill -9 of agent and workers: nothing cleans up
            first.log.close()
        assert os.listdir(shm) == ["n0"], "the killed node's store is still there"
        durable = max(e["step"] for e in events(run, "commit") if e["tier"] == "durable")
        second = Agent(DEMO, run, over, "n0", endpoint=etcd.endpoint, nproc=2)
        try:
            assert second.wait(300) == 0, second.output()[-3000:]
        finally:
            second.close()
    restores = [e for e in events(run, "restore") if e["step"] > 0]
    assert restores and {e["tier"] for e in restores} == {"durable"}
    assert restores[0]["step"] >= durable
    assert max(e["step"] for e in events(run, "step")) == 24
    assert not os.path.exists(shm), "a clean exit leaves no node store"
