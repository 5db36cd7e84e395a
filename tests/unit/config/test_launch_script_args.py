"""`resilient launch SCRIPT`: the command line, its errors (typed, exit code 2, before etcd or
any worker starts), the launch it resolves, and the runner a script's worker runs under
(real processes, no torch in them). The restart of a real script: test_launch_script.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launchutil import REPO
from resilient import launch
from resilient.agent.warm import LAUNCH_FLAGS, wants_zygote
from resilient.gpt.program import gpt_program
from resilient.cli import main
from resilient.launch_args import LaunchUsageError, _script_parser, parse_args

DEMO = str(REPO / "configs" / "demo.toml")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('training')\n")
    return str(path)


@pytest.fixture
def runtime_toml(tmp_path):
    path = tmp_path / "runtime.toml"
    path.write_text("[launch]\nspares = 0\nmax_restarts = 7\n[snapshot]\nevery = 5\n")
    return str(path)


def test_everything_after_the_script_goes_to_it_untouched(script):
    args = parse_args(["--nproc_per_node=2", "--rdzv-id", "job7", "--set", "snapshot.every=3", script,
                       "--set", "x", "-m", "--", "--nproc-per-node", "9"])
    assert args.form == "script" and args.target == script and not args.module
    assert args.script_args == ["--set", "x", "-m", "--", "--nproc-per-node", "9"]
    assert (args.nproc_per_node, args.run_id, args.overrides) == ("2", "job7", ["snapshot.every=3"])


def test_a_module_and_its_arguments():
    args = parse_args(["-m", "pkg.train", "--", "--lr", "1"])
    assert args.form == "script" and args.module and args.target == "pkg.train"
    assert args.script_args == ["--", "--lr", "1"]


def test_a_gpt_run_config_takes_its_options_after_it():
    args = parse_args([DEMO, "--run-dir", "r", "--set", "train.steps=3", "--max-restarts", "4", "--node_rank", "0"])
    assert args.form == "gpt" and args.config == DEMO
    assert (args.run_dir, args.overrides, args.max_restarts) == ("r", ["train.steps=3"], 4)


@pytest.mark.parametrize("argv,words", [
    (lambda t: ["--bogus", t["script"]], "unrecognized arguments: --bogus"),
    (lambda t: ["-m"], "-m needs a module"),
    (lambda t: ["--nproc-per-node", "2"], "nothing to run"),
    (lambda t: [DEMO, "--steps", "5"], "launched as the built-in GPT's run config"),
    (lambda t: ["--config", t["runtime"], DEMO], "is a TOML file where the script goes"),
])
def test_command_lines_that_name_nothing_runnable_are_usage_errors(argv, words, script, runtime_toml):
    with pytest.raises(LaunchUsageError, match=words):
        parse_args(argv({"script": script, "runtime": runtime_toml}))


def _refused(capsys, tmp_path, argv: list[str], words: str) -> None:
    run_dir = tmp_path / "run"
    assert main(["launch", "--run-dir", str(run_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("resilient launch: error:"), err
    assert not run_dir.exists()  # refused before the run dir, etcd or any worker


def test_a_script_that_does_not_exist_is_refused(capsys, tmp_path):
    _refused(capsys, tmp_path, [str(tmp_path / "nope.py"), "--lr", "1"], "nope.py does not exist")


def test_a_script_that_is_not_python_is_refused_with_what_it_is(capsys, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    _refused(capsys, tmp_path, [str(broken)], "is not valid Python")
    toml = tmp_path / "run.cfg"
    toml.write_text("[model]\ndim = 8\n")
    _refused(capsys, tmp_path, [str(toml)], "is a TOML file, not a Python script")


def test_a_runtime_config_launched_as_a_gpt_config_is_refused(capsys, tmp_path, runtime_toml):
    _refused(capsys, tmp_path, [runtime_toml], f"resilient launch --config {runtime_toml} SCRIPT")


def test_a_gpt_config_or_a_script_given_to_config_is_refused(capsys, tmp_path, script):
    _refused(capsys, tmp_path, ["--config", DEMO, script], "is not a runtime section")
    _refused(capsys, tmp_path, ["--config", script, script], "is a Python file: --config takes a runtime config")


def test_a_module_that_cannot_be_found_is_refused(capsys, tmp_path):
    _refused(capsys, tmp_path, ["-m", "no_such_module_here.train"], "no module named 'no_such_module_here'")
    _refused(capsys, tmp_path, ["-m", "train.py"], "is not a module name")


@pytest.mark.parametrize("flags,words", [(["--nproc-per-node", "0"], "--nproc-per-node must be ≥ 1"),
                                         (["--nproc-per-node", "many"], "expected a number, or gpu, cpu, auto"),
                                         (["--max-restarts", "-1"], "--max-restarts must be ≥ 0"),
                                         (["--standalone", "--nnodes", "2"], "--standalone is a one-node job"),
                                         (["--node-id", "../x"], "is not a valid name")])
def test_bad_launch_options_for_a_script_are_refused(capsys, tmp_path, script, flags, words):
    _refused(capsys, tmp_path, [*flags, script], words)


def test_the_help_shows_both_forms(capsys):
    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "resilient launch [OPTIONS] SCRIPT [ARGS...]" in out and "-m MODULE" in out
    assert "resilient launch CONFIG.toml" in out and "--rdzv-id" in out and "--nproc_per_node" in out


def test_wants_zygote_reads_a_scripts_runtime_config_and_only_the_options_before_it(script, runtime_toml):
    assert wants_zygote([script])                                  # spares default to nproc
    assert not wants_zygote(["--config", runtime_toml, script])    # spares = 0 there
    assert not wants_zygote([f"--config={runtime_toml}", "-m", "pkg"])
    assert not wants_zygote(["--nproc-per-node", "2", "--set", "launch.spares=0", script])
    assert wants_zygote([script, "--config", runtime_toml, "--set", "launch.spares=0"])  # the script's own
    assert not wants_zygote(["--config", str(Path(runtime_toml).parent / "missing.toml"), script])


def test_wants_zygote_knows_every_option_that_takes_no_value():
    flags = {s for a in _script_parser()._actions if a.nargs == 0 for s in a.option_strings}
    assert flags == LAUNCH_FLAGS


def test_a_script_launch_resolves_its_runtime_config_counts_and_digest(tmp_path, script, runtime_toml):
    def run(*argv: str) -> launch.Run:
        return launch.prepare_run(parse_args(["--run-dir", str(tmp_path / "run"), "--node-id", "n1", *argv]), gpt_program)

    r = run("--config", runtime_toml, "--set", "sdc.enable=false", "--nproc-per-node", "3", script, "--lr", "1")
    assert (r.nproc, r.nnodes, r.max_restarts, r.node) == (3, (1, 1), 7, "n1")
    assert r.worker_argv == [script, "--lr", "1"] and r.program.entry == "resilient.agent.script"
    assert not r.program.heartbeats and "torch.distributed" in r.program.preload
    written = json.loads(r.runtime_config.read_text())
    assert written["snapshot"]["every"] == 5 and written["sdc"]["enable"] is False
    assert (written["launch"]["nproc_per_node"], written["launch"]["max_restarts"]) == (3, 7)  # what runs
    assert r.runtime_config.parent == (tmp_path / "run").resolve()
    flags = run("--max-restarts", "2", "--nnodes", "1:3", script)
    assert flags.max_restarts == 2 and json.loads(flags.runtime_config.read_text())["launch"]["nnodes"] == "1:3"
    assert run("--nnodes", "1:3", script).nnodes == (1, 3) and run(script).nproc == 1
    # Nodes must agree on the script, its arguments and [sdc]; not on node-local knobs.
    digest = r.program.job_digest
    assert run("--config", runtime_toml, "--set", "sdc.enable=false", script, "--lr", "1").program.job_digest == digest
    assert run("--set", "sdc.enable=false", "--set", "snapshot.every=1", script, "--lr", "1").program.job_digest == digest
    assert run("--set", "sdc.enable=false", script, "--lr", "2").program.job_digest != digest
    assert run(script, "--lr", "1").program.job_digest != digest
    assert run("-m", "resilient.agent.script", "x").worker_argv == ["-m", "resilient.agent.script", "x"]


def _run_worker(tmp_path: Path, argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The script runner as a worker process runs it (no agent: the environment by hand)."""
    env = dict(os.environ, RESILIENT_RUN_DIR=str(tmp_path / "run"), RESILIENT_NODE_ID="n7", RANK="3",
               PYTHONPATH=str(REPO))
    code = "import sys; from resilient.agent.script import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd or tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_runner_runs_a_script_as_python_does_and_exits_with_its_code(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "helper.py").write_text("VALUE = 41\n")
    (sub / "train.py").write_text(
        "import atexit, json, sys\nimport helper\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__, 'v': helper.VALUE}))\n"
        "sys.exit(int(sys.argv[1]))\n")
    out = _run_worker(tmp_path, ["sub/train.py", "3", "--x", "--"])
    assert out.returncode == 3, out.stderr
    seen = json.loads(out.stdout.splitlines()[0])
    assert seen == {"argv": ["sub/train.py", "3", "--x", "--"], "path0": str(sub.resolve()), "name": "__main__", "v": 41}
    assert "atexit ran" in out.stdout
    assert _run_worker(tmp_path, ["sub/train.py", "0"]).returncode == 0


def test_the_runner_runs_a_module_from_the_current_directory(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import sys\nprint(sys.argv[1:], __name__)\n")
    out = _run_worker(tmp_path, ["-m", "mypkg.train", "--lr", "1"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['--lr', '1'] __main__"


def test_an_uncaught_exception_is_a_traceback_a_worker_error_event_and_exit_1(tmp_path):
    (tmp_path / "bad.py").write_text("def step():\n    raise ValueError('loss is nan')\nstep()\n")
    out = _run_worker(tmp_path, ["bad.py"])
    assert out.returncode == 1
    assert "ValueError: loss is nan" in out.stderr and 'bad.py", line 2, in step' in out.stderr
    assert "runpy" not in out.stderr  # the script's frames, as python prints them
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["node"], e["rank"], e["error"]) for e in events] == [
        ("worker_error", "n7", 3, "ValueError: loss is nan")]


def test_a_run_config_is_run_by_the_program_installed_for_it(monkeypatch, capsys, tmp_path):
    """Issue 40: the runtime never names the trainer: the built-in GPT registers its
    ProgramPlugin under the entry-point group resilient.programs, where launch, `resilient
    config`, `doctor` and the command list find it; none installed is a clear error (runtime
    configs still work, the GPT's `data` command is gone), several a refusal to guess."""
    import importlib.metadata as md

    from resilient.cli import main
    from resilient.errors import LaunchError
    from resilient.gpt.program import GPT

    assert launch.config_program() is GPT and GPT.program is gpt_program
    assert main(["--help"]) == 0 and "  data     prepare a token corpus" in capsys.readouterr().out
    assert main(["config", "configs/demo.toml"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["n_layers"] > 0
    runtime = tmp_path / "runtime.toml"
    runtime.write_text("[snapshot]\nevery = 3\n")

    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group=None: [] if group == launch.PROGRAMS else real(group=group))
    assert launch.config_program() is None
    with pytest.raises(LaunchError, match="no program is installed"):
        launch.prepare_run(parse_args(["configs/demo.toml"]))
    assert main(["config", str(runtime)]) == 0   # a runtime config needs no program
    assert json.loads(capsys.readouterr().out)["snapshot"]["every"] == 3
    assert main(["config", "configs/demo.toml"]) == 2
    assert "no program is installed" in capsys.readouterr().err
    assert main(["config", "--explain"]) == 0
    knobs = capsys.readouterr().out
    assert "snapshot.every" in knobs and "model." not in knobs
    assert main(["data", "prepare", "x", "y"]) == 2 and "unknown command 'data'" in capsys.readouterr().err

    two = [md.EntryPoint(n, "resilient.gpt.program:GPT", launch.PROGRAMS) for n in ("a", "b")]
    monkeypatch.setattr(md, "entry_points", lambda group=None: two if group == launch.PROGRAMS else real(group=group))
    with pytest.raises(LaunchError, match=r"several programs .*\(a, b"):
        launch.config_program()
    assert main(["--help"]) == 2 and "several programs" in capsys.readouterr().err
    old = [md.EntryPoint("gpt", "resilient.gpt.program:gpt_program", launch.PROGRAMS)]  # a factory: the old interface
    monkeypatch.setattr(md, "entry_points", lambda group=None: old if group == launch.PROGRAMS else real(group=group))
    with pytest.raises(LaunchError, match="not a resilient.launch.ProgramPlugin"):
        launch.config_program()


def test_rdzv_conf_keys_that_are_launch_knobs_set_the_knob(tmp_path, script):
    """--rdzv-conf join_timeout (torchrun's spelling) and launch.join_timeout are one setting:
    the agent's waits and the rendezvous use the same value, range-checked as the knob."""
    def run(*argv: str) -> dict:
        r = launch.prepare_run(parse_args(["--run-dir", str(tmp_path / "run"), "--node-id", "n1", *argv]), gpt_program)
        return json.loads(r.runtime_config.read_text())["launch"]

    got = run("--rdzv-conf", "join_timeout=90,last_call_timeout=0.5,keep_alive_interval=2,key_prefix=/x", script)
    assert (got["join_timeout"], got["last_call_timeout"], got["keep_alive_interval"]) == (90.0, 0.5, 2.0)
    assert run("--set", "launch.join_timeout=30", script)["join_timeout"] == 30.0
    from resilient.errors import ConfigError
    with pytest.raises(ConfigError, match="join_timeout"):
        run("--rdzv-conf", "join_timeout=-5", script)
    with pytest.raises(LaunchUsageError, match="expected seconds"):
        run("--rdzv-conf", "join_timeout=soon", script)


def test_the_rdzv_conf_keys_that_set_knobs_are_the_ones_the_rendezvous_marks():
    from resilient.launch_args import RDZV_CONF_KNOBS
    from resilient.rendezvous.registry import RDZV_CONF
    from resilient.runconfig import LaunchConfig

    marked = {k.name for k in RDZV_CONF.values() if k.knob}
    assert marked == set(RDZV_CONF_KNOBS) and marked <= set(vars(LaunchConfig()))
