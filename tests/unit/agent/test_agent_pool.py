"""The warm zygote: it forks workers, reports their exit codes, and is replaced
when it dies (a real process, real fork, no training)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest

from resilient.agent.pool import ForkedWorker, WarmPool

pytestmark = pytest.mark.timeout(180)


def _wait_ready(pool: WarmPool, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pool._zygote is not None and pool._zygote.ready:
            return
        time.sleep(0.1)
    raise AssertionError("the zygote did not finish importing")


def test_zygote_forks_workers_and_reports_their_exit_codes():
    pool = WarmPool(1, {})
    try:
        pool.fill()
        _wait_ready(pool)
        wp, warm = pool.take()
        assert isinstance(wp, ForkedWorker) and warm
        t0 = time.monotonic()
        # A worker given no config exits with argparse's usage error (2): reported by the zygote.
        wp.assign({}, ["--no-such-flag"])
        assert wp.pid > 0 and wp.pid != pool._zygote.proc.pid
        assert wp.wait(timedelta(seconds=60)) == 2
        assert time.monotonic() - t0 < 60
        zygote_pid = pool._zygote.proc.pid
        # The zygote dies (kill -9): the pool starts another and forking works again.
        os.kill(zygote_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pool._zygote.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        wp2, _ = pool.take()
        assert pool._zygote.proc.pid != zygote_pid
        wp2.assign({}, ["--no-such-flag"])
        assert wp2.wait(timedelta(seconds=120)) == 2
    finally:
        pool.close()
    assert pool._zygote is None


def test_without_spares_workers_are_cold_processes():
    pool = WarmPool(0, {})
    try:
        wp, warm = pool.take()
        assert not warm and not isinstance(wp, ForkedWorker)
        wp.discard()
    finally:
        pool.close()


def test_an_early_zygote_is_adopted_and_forks_workers():
    """warm.start_early (before the agent's imports): the pool adopts that process instead of
    starting another, and it forks workers like any zygote."""
    from resilient.agent import warm

    warm.start_early()
    early_pid = warm._early[0].pid
    pool = WarmPool(1, {})
    try:
        pool.fill()
        assert pool._zygote.proc.pid == early_pid and warm.take_early() is None
        _wait_ready(pool)
        wp, _ = pool.take()
        wp.assign({"OMP_NUM_THREADS": "1"}, ["--no-such-flag"])
        assert wp.wait(timedelta(seconds=60)) == 2
    finally:
        pool.close()


def test_an_early_zygote_is_killed_when_the_agent_keeps_no_spares():
    from resilient.agent import warm

    warm.start_early()
    proc = warm._early[0]
    pool = WarmPool(0, {})
    try:
        pool.fill(1)
        assert proc.poll() is not None and warm.take_early() is None
    finally:
        pool.close()


def test_wants_zygote_reads_spares_from_the_config_and_the_overrides(tmp_path):
    from resilient.agent.warm import wants_zygote

    cfg = tmp_path / "c.toml"
    cfg.write_text("[launch]\nspares = 0\n")
    assert not wants_zygote([str(cfg)])
    assert wants_zygote([str(cfg), "--set", "launch.spares=2"])
    cfg.write_text("[model]\ndim = 8\n")
    assert wants_zygote([str(cfg), "--run-dir", "x"])
    assert not wants_zygote([str(cfg), "--set=launch.spares=0"])
    assert not wants_zygote([str(tmp_path / "missing.toml")])  # unclear: no early zygote
