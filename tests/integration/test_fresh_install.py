"""Install as users install: a wheel built from the checkout carries everything the CLI
reads, and installed into a fresh venv (not an editable install) it runs the demo from
outside the checkout.

The venv reuses this machine's packages (``--system-site-packages``: torch and the
other dependencies are not downloaded again) and gets only the wheel (``--no-deps``);
its own copy of resilient shadows the checkout's editable one, which the test checks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from launchutil import REPO, events
from nsutil import run_isolated

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Package folders of the checkout → their import names in the wheel (pyproject's package-dir).
PACKAGE_DIRS = {"resilient": "resilient", "tools": "resilient_tools", "chaos": "resilient_chaos",
                "configs": "resilient_configs"}


def checkout_files() -> list[str]:
    """What a clone of the checkout holds: tracked files and new ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def expected_in_wheel(files: list[str]) -> set[str]:
    """Every module and data file of the package folders, under its installed name."""
    want = set()
    for f in files:
        top, _, rest = f.partition("/")
        if top in PACKAGE_DIRS and rest and not rest.endswith((".pyc", ".md")):  # docs: read on GitHub
            want.add(f"{PACKAGE_DIRS[top]}/{rest}")
    return want


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout (the build writes build/ and egg-info
    next to the sources: not in the shared checkout)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know its files")
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    (whl,) = dist.glob("resilient-*.whl")
    return whl


def test_wheel_carries_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    files = checkout_files()
    missing = sorted(expected_in_wheel(files) - names)
    assert not missing, f"not in the wheel (pyproject.toml packages / package-data): {missing}"
    for must in ("resilient/sdc/native.c", "resilient_configs/demo.toml", "resilient_chaos/scenarios/kill-worker.toml",
                 "resilient/rendezvous/worker_site/sitecustomize.py"):
        assert must in names


def fresh_venv(where: Path) -> Path:
    """A venv that sees this machine's packages but not its editable install of resilient.

    Why not ``--system-site-packages``: the checkout's editable install is a meta-path
    finder set up by a ``.pth`` file there; it would serve any module the wheel lacks
    (``resilient.gpt`` before it was listed) from the checkout, and a missing package
    would go unnoticed. A plain path entry to the system's site-packages makes torch and
    the other dependencies importable without running that directory's ``.pth`` files."""
    import site
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    system = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    (Path(purelib) / "_machine_packages.pth").write_text("\n".join(system) + "\n")
    return py


# Prints every loaded module's file under the folder argv[1], compared as paths: a venv beside the
# checkout under its name plus "-venv" ("resilient-venv" beside "resilient") is not inside it.
FROM_CHECKOUT = """
import sys
from pathlib import Path
print("\\n".join(m.__file__ for m in list(sys.modules.values())
                 if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve())))
"""
# Imported in the venv; every module they bring in must come from the venv, none from the checkout.
PROBE = """
import sys, resilient.cli, resilient.launch, resilient.gpt.program, resilient.gpt.worker, resilient_tools.cli
import resilient_chaos.runner as r, resilient_chaos.scenario as s
print(r.resolve_config(s.load_scenario('kill-worker')))
""" + FROM_CHECKOUT


def test_probe_compares_paths_not_string_prefixes(tmp_path):
    """A module read from ``resilient-venv`` is not "from the checkout" ``resilient`` (issue 44: every
    module of such a venv was flagged when the probe compared strings); one inside the checkout is."""
    checkout, venv = tmp_path / "resilient", tmp_path / "resilient-venv"
    for folder, name in ((checkout, "in_checkout_mod"), (venv, "in_venv_mod")):
        folder.mkdir()
        (folder / f"{name}.py").write_text("")
    code = f"import sys; sys.path[:0] = [{str(checkout)!r}, {str(venv)!r}]; import in_checkout_mod, in_venv_mod\n"
    out = subprocess.run([sys.executable, "-c", code + FROM_CHECKOUT, str(checkout)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str((checkout / "in_checkout_mod.py").resolve())]


def test_wheel_in_a_fresh_venv_runs_the_demo(wheel, tmp_path, corpus):
    venv = tmp_path / "venv"
    py = fresh_venv(venv)
    # This machine's pip (importable through the path entry) installs into the venv it runs in.
    inst = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert inst.returncode == 0, inst.stderr[-3000:]
    work = tmp_path / "elsewhere"  # not the checkout: nothing is read from it
    work.mkdir()
    where = subprocess.run([str(py), "-c", PROBE, str(REPO)], cwd=work, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-3000:]
    scenario_config, *from_checkout = where.stdout.split()
    assert Path(scenario_config).is_relative_to(venv) and not from_checkout, where.stdout

    run_dir = work / "run"
    out = run_isolated([str(venv / "bin" / "resilient"), "launch", "configs/demo.toml", "--run-dir", str(run_dir),
                        "--set", "train.steps=3", "--set", "train.eval_every=0", "--set", f"data.path={corpus}",
                        "--set", 'data.source=""'], cwd=work)
    assert out.returncode == 0, out.stdout[-4000:]
    assert not out.leftover, out.leftover
    assert sorted({e["step"] for e in events(run_dir, "step")}) == [1, 2, 3]
