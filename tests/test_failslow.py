"""The fail-slow detector on synthetic timings (resilient.failslow.synthetic: what a slow
device, host or link does to a synchronous step), its policy arithmetic, its knobs, and
the step timer's accounting. The real processes are in test_failslow_multiproc.py."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.errors import ConfigError
from resilient.failslow import Detector, FailSlowConfig, FailSlowError
from resilient.failslow.api import PHASES, Straggler
from resilient.failslow.policy import decide
from resilient.failslow.synthetic import clean_rows, slow_down
from resilient.failslow.timing import StepTimer
from resilient.runconfig import load_runtime_config

START = 20   # steps of clean history before a slowdown starts (warmup is 8)


def run(world, *, seed, steps, cause=None, factor=1.0, ranks=(), nodes=None, **noise):
    """Feed the detector; returns (verdicts, step of the first verdict after START or None)."""
    rng = random.Random(seed)
    det = Detector(FailSlowConfig(), nodes or [f"n{r}" for r in range(world)])
    verdicts, first = [], None
    for step in range(1, steps + 1):
        rows = clean_rows(rng, world, **noise)
        if cause is not None and step > START:
            rows = slow_down(rows, cause, factor, ranks=ranks)
        out = det.observe(step, rows)
        verdicts += out
        if out and first is None:
            first = step - START
    return verdicts, first


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), world=st.integers(2, 8), sigma=st.floats(0.0, 0.08),
       imbalance=st.lists(st.floats(0.5, 2.0), max_size=8))
def test_clean_noisy_timings_never_alarm(seed, world, sigma, imbalance):
    """Noise, rare one-step hiccups and ranks that always compute more than the others
    (a pipeline's last stage) are nobody's straggling."""
    verdicts, _ = run(world, seed=seed, steps=400, sigma=sigma, spike=0.005, imbalance=imbalance)
    assert verdicts == []


def test_a_thousand_clean_steps_raise_nothing():
    verdicts, _ = run(4, seed=7, steps=1000, sigma=0.06)
    assert verdicts == []


def test_the_whole_job_slowing_down_is_not_a_straggler():
    rng = random.Random(3)
    det = Detector(FailSlowConfig(), ["a", "b", "c"])
    for step in range(1, 200):
        rows = clean_rows(rng, 3)
        if step > START:   # every rank 2x: a bigger batch, a slower shared file system
            rows = [[v * 2 for v in r] for r in rows]
        assert det.observe(step, rows) == []


@pytest.mark.parametrize("factor,bound", [(1.3, 20), (2.0, 5), (3.0, 5)])
@pytest.mark.parametrize("seed", range(10))
def test_a_slow_rank_is_found_within_its_bound_as_a_device(factor, bound, seed):
    verdicts, first = run(4, seed=seed, steps=START + 40, cause="device", factor=factor, ranks=[2])
    assert first is not None and first <= bound, (first, verdicts)
    v = verdicts[0]
    assert (v.cause, v.slow_rank, v.slow_ranks, v.slow_node) == ("device", 2, [2], "n2")
    assert factor / 1.25 < v.factor < factor * 1.25, v.factor
    assert v.evidence["wait_seconds"] < v.evidence["others_wait_median"]   # the others wait for it


@pytest.mark.parametrize("seed", range(5))
def test_every_rank_of_one_node_slow_is_the_host(seed):
    nodes = ["a", "a", "b", "b", "c", "c"]
    verdicts, first = run(6, seed=seed, steps=START + 30, cause="host", factor=2.0, ranks=[2, 3], nodes=nodes)
    assert first is not None and first <= 6, first
    assert [(v.cause, v.slow_node, v.slow_ranks) for v in verdicts] == [("host", "b", [2, 3])]


@pytest.mark.parametrize("seed", range(5))
def test_slower_collectives_with_nobody_computing_slower_is_a_link(seed):
    # the transfer is a tenth of the step: a 5x slower link makes the step ~1.4x
    verdicts, first = run(4, seed=seed, steps=START + 30, cause="link", factor=5.0, transfer=0.003)
    assert first is not None and first <= 20, first
    assert [v.cause for v in verdicts] == ["link"]


def test_a_verdict_is_raised_once_and_rearmed_after_recovery():
    rng = random.Random(1)
    det = Detector(FailSlowConfig(), ["a", "b", "c"])
    causes = []
    for step in range(1, 200):
        rows = clean_rows(rng, 3)
        if 20 < step <= 60 or step > 120:   # slow, healthy again, slow again
            rows = slow_down(rows, "device", 2.0, ranks=[0])
        causes += [(v.cause, v.slow_rank) for v in det.observe(step, rows)]
    assert causes == [("device", 0), ("device", 0)]


def test_a_rearmed_verdict_comes_again_while_the_rank_is_still_slow():
    rng = random.Random(4)
    det = Detector(FailSlowConfig(), ["a", "b", "c"])
    seen = []
    for step in range(1, 90):
        rows = clean_rows(rng, 3)
        if step > START:
            rows = slow_down(rows, "device", 2.0, ranks=[2])
        seen += [step for v in det.observe(step, rows)]
        if step == 50:   # a replace found no seat at the first verdict: ask again (monitor.NO_SEAT_RETRY)
            assert len(seen) == 1
            det.rearm([2])
    assert len(seen) == 2 and 50 < seen[1] <= 50 + 6, seen


def _straggler(factor: float, cause: str = "device") -> Straggler:
    return Straggler(step=100, cause=cause, factor=factor, slow_rank=1, slow_ranks=[1], slow_node="b",
                     steps_of_evidence=5)


def test_the_cost_model_acts_only_when_the_remaining_loss_exceeds_a_reform():
    cfg = FailSlowConfig(policy="report")
    long = decide(cfg, _straggler(2.0), step_seconds=1.0, remaining_steps=1000, reform_seconds=30.0)
    assert long.pays and long.action == "report"     # report never acts, but says it would pay
    link = decide(cfg, _straggler(2.0, "link"), step_seconds=1.0, remaining_steps=1000, reform_seconds=30.0)
    assert not link.pays and "not fixed by replacing a node" in link.reason
    assert long.loss_per_step_seconds == pytest.approx(0.5) and long.expected_loss_seconds == pytest.approx(500)
    short = decide(cfg, _straggler(2.0), step_seconds=1.0, remaining_steps=40, reform_seconds=30.0)
    assert not short.pays and "≤ a re-form's 30.0 s" in short.reason
    unknown = decide(cfg, _straggler(2.0), step_seconds=1.0, remaining_steps=None, reform_seconds=30.0)
    assert not unknown.pays
    floor = decide(FailSlowConfig(min_remaining_steps=2000), _straggler(2.0), step_seconds=1.0,
                   remaining_steps=1000, reform_seconds=30.0)
    assert not floor.pays and "min_remaining_steps" in floor.reason
    fields = long.fields()
    assert set(fields) >= {"policy", "action", "pays", "expected_loss_seconds", "reform_seconds", "reason"}


@pytest.mark.parametrize("seat", ["spare", "shrink"])
def test_the_replace_policy_acts_on_a_long_run_declines_a_short_one_and_never_a_link(seat):
    cfg = FailSlowConfig(policy="replace")
    weigh = dict(step_seconds=1.0, reform_seconds=30.0, seat=seat)
    long = decide(cfg, _straggler(2.0), remaining_steps=1000, **weigh)
    assert (long.action, long.pays, long.seat) == ("replace", True, seat) and "node b leaves" in long.reason
    host = decide(cfg, _straggler(2.0, "host"), remaining_steps=1000, **weigh)
    assert host.action == "replace"
    short = decide(cfg, _straggler(2.0), remaining_steps=40, **weigh)      # loses 20 s < a 30 s re-form
    assert (short.action, short.pays) == ("report", False) and "≤ a re-form's 30.0 s" in short.reason
    slight = decide(cfg, _straggler(1.02), remaining_steps=1000, **weigh)  # 19.6 s < 30 s however long
    assert slight.action == "report"
    for factor, remaining in [(1.5, 100), (2.0, 1000), (10.0, 10**6)]:
        link = decide(cfg, _straggler(factor, "link"), remaining_steps=remaining, **weigh)
        assert (link.action, link.pays) == ("report", False) and "not fixed by replacing a node" in link.reason
    for nobody in ("none", None):   # nobody to take the seat: acting would only re-form
        d = decide(cfg, _straggler(2.0), step_seconds=1.0, remaining_steps=1000, reform_seconds=30.0, seat=nobody)
        assert (d.action, d.pays) == ("report", True) and "not replaced" in d.reason
    assert decide(FailSlowConfig(policy="report"), _straggler(2.0), remaining_steps=1000, **weigh).action == "report"


def test_a_seat_is_a_spare_else_a_shrink_above_the_minimum_else_none(tmp_path):
    from resilient.failslow.replace import local_seat, seat_of

    assert seat_of(round_size=2, spares=1, min_nodes=2) == "spare"
    assert seat_of(round_size=3, spares=0, min_nodes=2) == "shrink"
    assert seat_of(round_size=2, spares=0, min_nodes=2) == "none"
    path = tmp_path / "seats.json"
    assert local_seat(str(path)) is None                       # the agent has not written it yet
    path.write_text('{"seat": "spare"}')
    assert local_seat(str(path)) == "spare"
    path.write_text('{"seat": "everyone"}')
    assert local_seat(str(path)) is None


@pytest.mark.parametrize("key,value,words", [
    ("every", 0, "every = 0"), ("warmup", 1, "warmup = 1"), ("threshold", 1.0, "must be > 1"),
    ("evidence", 0, "must be > 0"), ("reform_seconds", -1, "use 0 for measured"), ("policy", "evict", "is not one of"),
    ("rejoin_probes", 0, "rejoin_probes = 0"), ("rejoin_interval", 0, "rejoin_interval = 0"),
])
def test_bad_knobs_are_config_errors_that_say_the_fix(key, value, words):
    with pytest.raises(ConfigError, match=words):
        load_runtime_config(None, [f"failslow.{key}={value!r}" if isinstance(value, str) else f"failslow.{key}={value}"])


def test_the_detector_refuses_what_it_cannot_judge():
    with pytest.raises(FailSlowError, match="at least 2 ranks"):
        Detector(FailSlowConfig(), ["only"])
    det = Detector(FailSlowConfig(), ["a", "b"])
    with pytest.raises(FailSlowError, match="3 rows for 2 ranks"):
        det.observe(1, [[0.0] * len(PHASES)] * 3)


def test_the_step_timer_splits_the_wall_time_and_refuses_nesting():
    timer = StepTimer(None)
    timer.lap()
    with timer.phase("data"):
        sum(range(20000))
    with timer.phase("snapshot"):
        sum(range(20000))
    compute, wait, data, snapshot, wall, queued = timer.lap()
    assert data > 0 and snapshot > 0 and wait == 0.0
    assert compute + wait + data + snapshot == pytest.approx(wall)
    with pytest.raises(FailSlowError, match="do not nest"):
        with timer.phase("data"):
            with timer.phase("wait"):
                pass
    with pytest.raises(FailSlowError, match="compute is what is left"):
        with timer.phase("compute"):
            pass
    timer.close()


_INTRA_OP_DELAY = """
import os, subprocess, sys, threading, time
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[0]})   # before torch: its intra-op pool is made on the first CPU
import torch
from resilient.failslow.timing import ProcessRunDelay, open_run_delay, run_delay
torch.set_num_threads(2)
a = torch.randn(256, 256)
a @ a                                     # the intra-op pool exists from here
os.sched_setaffinity(0, {cpus[1]})        # the training thread alone moves to the second CPU
stop = threading.Event()
side = threading.Thread(target=stop.wait) # a Python thread (a snapshot writer): not the step's
side.start()
hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {%d}); exec('while True: pass')" % cpus[0]])
time.sleep(0.2)
def each():
    out = {}
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/schedstat") as f:
            out[int(t)] = int(f.read().split()[1]) * 1e-9
    return out
delay, fd = ProcessRunDelay(), open_run_delay()
total0, mine0, each0 = delay.read(), run_delay(fd), each()
chosen = {int(t) for t in delay._fds}
t0 = time.perf_counter()
while time.perf_counter() - t0 < 0.8:
    b = torch.randn(512, 512)
    b @ b
total, mine, each1 = delay.read() - total0, run_delay(fd) - mine0, each()
hog.kill(); hog.wait(); stop.set(); side.join()
me = threading.get_native_id()
pool = max(each1[t] - each0.get(t, each1[t]) for t in chosen - {me})
print(total, mine, pool, me in chosen, side.native_id in chosen)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not hasattr(os, "sched_setaffinity")
                    or len(os.sched_getaffinity(0)) < 2, reason="per-thread schedstat and affinity are Linux's; 2 CPUs")
def test_the_run_queue_delay_holds_a_starved_intra_op_thread_not_only_the_training_threads():
    """The training thread's matrix products run on two intra-op threads; its pool mate shares
    a CPU with a busy process, the training thread has another. The step's run-queue delay
    must hold the starved pool thread's (it stretches the step while the training thread,
    waiting for it, is not queued), and the threads read are the training thread and the
    pool's, not a Python thread beside the step."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _INTRA_OP_DELAY], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    total, mine, pool, main_read, python_read = out.stdout.split()
    total, mine, pool = float(total), float(mine), float(pool)
    assert (main_read, python_read) == ("True", "False"), out.stdout
    assert pool > 0.1, (total, mine, pool)     # the pool thread waited for the busy process's CPU
    # the step's delay is the most delayed of the step's threads: the pool thread's when it
    # waited longer than the training thread (never less than the training thread's own)
    assert total >= max(mine, pool) - 0.005 and total <= max(mine, pool) + 0.05, (total, mine, pool)


def test_the_probe_names_a_slow_compute_a_host_or_the_link_they_share():
    from resilient.failslow.probe import judge

    nodes = ["a", "a", "b", "b", "c", "c"]
    ok = [0.04] * 6
    fast_edges = [0.001] * 6
    device = judge([0.04, 0.04, 0.04, 0.09, 0.04, 0.04], fast_edges, nodes)
    assert (device["cause"], device["slow_rank"], device["slow_node"]) == ("device", 3, "b")
    host = judge([0.04, 0.04, 0.09, 0.08, 0.04, 0.04], fast_edges, nodes)
    assert (host["cause"], host["slow_ranks"], host["slow_node"]) == ("host", [2, 3], "b")
    # node b's link drops packets: the edges crossing into it (1→2) and out of it (3→4) are slow
    link = judge(ok, [0.001, 0.001, 0.2, 0.001, 0.05, 0.001], nodes)
    assert (link["cause"], link["slow_node"]) == ("link", "b") and link["evidence"]["slow_edges"] == [[1, 2], [3, 4]]
    # one rank's NIC: both its ring edges
    nic = judge([0.04] * 4, [0.001, 0.2, 0.1, 0.001], ["a", "b", "c", "d"])
    assert (nic["cause"], nic["slow_rank"], nic["slow_node"]) == ("link", 1, "b")
    nothing = judge(ok, fast_edges, nodes)
    assert (nothing["cause"], nothing["slow_rank"]) == ("link", None)


def test_the_chaos_property_wants_the_right_cause_and_target_within_the_bound():
    from resilient_chaos.properties import stragglers_found

    def node_id(i):
        return f"n{i}"

    def timeline(*verdicts, kind="slow-rank", target="rank:1"):
        evs = [{"event": "fault_injected", "fault": kind, "target": target, "fault_id": "f0", "status": "injected", "time": 10.0}]
        evs += [{"event": "step", "step": s, "time": 10.0 + s, "rank": 0} for s in range(1, 30)]
        evs += [{"event": "straggler", "time": 10.0 + v["step"] + 0.5, **v} for v in verdicts]
        return sorted(evs, key=lambda e: e["time"])

    ok = stragglers_found(timeline({"step": 4, "cause": "device", "slow_rank": 1, "slow_node": "n0"}), 5, node_id)
    assert ok.ok and "after 4 step(s)" in ok.detail
    late = stragglers_found(timeline({"step": 9, "cause": "device", "slow_rank": 1, "slow_node": "n0"}), 5, node_id)
    assert not late.ok and "> bound 5" in late.detail
    wrong = stragglers_found(timeline({"step": 2, "cause": "device", "slow_rank": 0, "slow_node": "n0"}), 5, node_id)
    assert not wrong.ok and "no straggler event named it" in wrong.detail
    host = timeline({"step": 3, "cause": "host", "slow_rank": 2, "slow_node": "n1"}, kind="slow-host", target="node:1")
    assert stragglers_found(host, 5, node_id).ok
    link = timeline({"step": 3, "cause": "link", "slow_rank": 1, "slow_node": "n2"}, kind="slow-link", target="link:1-2")
    assert stragglers_found(link, 5, node_id).ok


@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=12))
def test_the_median_of_the_others_is_computed_with_one_sort(values):
    from statistics import median

    from resilient.failslow.detector import medians_without_each

    assert medians_without_each(values) == pytest.approx([median(values[:i] + values[i + 1:]) for i in range(len(values))])
