"""torchrun workers end their process group at exit (resilient/rendezvous/worker_exit.py).

The abort it prevents is a race inside torch at interpreter exit (4 of 30 runs on a loaded
host): tests/integration/test_rendezvous_torchrun.py runs the script end to end; here, deterministically,
what the hook does in a worker's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from resilient.rendezvous.worker_exit import SITE_DIR, install_worker_exit_hook


def test_the_hook_goes_first_on_the_workers_path_once_and_keeps_the_users_entries():
    env = {"PYTHONPATH": os.pathsep.join(["/opt/mine", "", "/opt/theirs"])}
    install_worker_exit_hook(env)
    install_worker_exit_hook(env)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/opt/mine", "/opt/theirs"]
    empty: dict[str, str] = {}
    install_worker_exit_hook(empty)
    assert empty == {"PYTHONPATH": str(SITE_DIR)}
    assert (SITE_DIR / "sitecustomize.py").is_file() and [p.name for p in SITE_DIR.iterdir()
                                                          if p.suffix == ".py"] == ["sitecustomize.py"]


def _worker(tmp_path, code: str, extra_path: list[str] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(extra_path)
    install_worker_exit_hook(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_a_script_that_leaves_its_process_group_has_it_destroyed_after_its_own_exit_handlers(tmp_path):
    proc = _worker(tmp_path, f"""
        import atexit, torch, torch.distributed as dist
        store = dist.FileStore({str(tmp_path / "store")!r}, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        t = torch.ones(3); dist.all_reduce(t)
        # the script's own handler runs first, with the group still there
        atexit.register(lambda: print("script handler: initialized", dist.is_initialized()))
        atexit._run_exitfuncs()   # what the interpreter does at exit, here where we can look after it
        print("after exit handlers: initialized", dist.is_initialized())
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["script handler: initialized True", "after exit handlers: initialized False"]


def test_a_script_without_torch_is_left_alone_and_the_shadowed_sitecustomize_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins; builtins.THEIRS_RAN = True\n")
    proc = _worker(tmp_path, """
        import sys, builtins
        print(getattr(builtins, "THEIRS_RAN", False), "torch" in sys.modules)
    """, extra_path=[str(theirs)])
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "False"], proc.stderr
