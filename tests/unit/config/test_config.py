"""Config loading: typed sections, clear errors naming key, file and fix."""

from __future__ import annotations

import pytest

from resilient.gpt.config import explain_all, load_config
from resilient.errors import ConfigError

from launchutil import REPO


def write(tmp_path, text: str):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_shipped_configs_load_and_validate():
    for path in sorted((REPO / "configs").glob("*.toml")):
        cfg = load_config(path)
        cfg.validate_layout(cfg.default_world_size())


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    p = write(tmp_path, "[train]\nstep = 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "train.step" in msg and str(p) in msg and "did you mean 'train.steps'" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trian'.*did you mean 'train'"):
        load_config(write(tmp_path, "[trian]\nsteps = 1\n"))


def test_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="'train.steps' must be int, got 'ten'"):
        load_config(write(tmp_path, '[train]\nsteps = "ten"\n'))
    with pytest.raises(ConfigError, match="'parallel.activation_checkpoint' must be bool"):
        load_config(write(tmp_path, "[parallel]\nactivation_checkpoint = 1\n"))


def test_int_is_a_fine_float(tmp_path):
    assert load_config(write(tmp_path, "[train]\nlr = 1\n")).train.lr == 1.0


def test_choices(tmp_path):
    with pytest.raises(ConfigError, match="'parallel.pp_schedule' = 'zb' is not one of"):
        load_config(write(tmp_path, '[parallel]\npp_schedule = "zb"\n'))


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nsteps = 10\n"),
                      ["train.steps=100", "train.dtype=bf16", "data.path=/x/y", "parallel.activation_checkpoint=true"])
    assert cfg.train.steps == 100 and cfg.train.dtype == "bf16"
    assert cfg.data.path == "/x/y" and cfg.parallel.activation_checkpoint is True
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        load_config(None, ["train.stepz=3"])


@pytest.mark.parametrize("sets, world, match", [
    ({"parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 2}, 4, "does not match the world size 4"),
    ({"parallel.pp": 2, "parallel.tp": 2}, 6, "not divisible by pp×tp"),
    ({"parallel.pp": 3, "model.n_layers": 4}, 3, "cannot be split into 3 pipeline stages"),
    ({"parallel.tp": 3, "model.n_heads": 4, "model.dim": 96}, 3, "'model.n_heads' = 4 is not divisible by 'parallel.tp' = 3"),
    ({"train.global_batch": 6}, 4, "not divisible by dp = 4"),
    ({"parallel.pp": 2, "parallel.microbatches": 1}, 2, "micro-batches cannot fill 2"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b"}, 2, "stages_per_rank' ≥ 2"),
    ({"parallel.pp": 2, "parallel.stages_per_rank": 2, "parallel.pp_schedule": "zero-bubble"}, 4,
     "silently wrong"),
    ({"train.seq_len": 512}, 1, "exceeds 'model.max_seq_len'"),
])
def test_impossible_layouts(sets, world, match):
    cfg = load_config(None, [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in sets.items()])
    with pytest.raises(ConfigError, match=match):
        cfg.validate_layout(world)


def test_auto_dp_follows_world_size():
    cfg = load_config(None, ["parallel.pp=2", "parallel.microbatches=2", "train.global_batch=12"])
    assert cfg.layout(4) == (2, 2, 1) and cfg.layout(6) == (2, 3, 1)


def test_explain_documents_every_knob():
    text = explain_all()
    for key in ("model.dim", "parallel.zero", "train.global_batch", "snapshot.every", "launch.nproc_per_node"):
        line = next(l for l in text.splitlines() if l.startswith(key + " "))
        assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, line


@pytest.mark.parametrize("key", ["model.n_heads", "model.multiple_of", "model.dim", "model.vocab_size",
                                 "model.n_layers", "model.max_seq_len", "train.global_batch",
                                 "train.seq_len", "train.eval_batches"])
def test_sizes_must_be_positive_before_any_division(key):
    cfg = load_config(None, [f"{key}=0"])
    with pytest.raises(ConfigError, match=f"'{key}' must be ≥ 1, got 0"):
        cfg.validate_layout(1)


@pytest.mark.parametrize("key", ["model.ffn_dim", "parallel.dp", "parallel.microbatches", "train.steps",
                                 "launch.nproc_per_node"])
def test_automatic_counts_must_not_be_negative(key):
    with pytest.raises(ConfigError, match=f"'{key}' must be ≥ 0"):  # a runtime knob: refused as it is read
        load_config(None, [f"{key}=-2"]).validate_layout(1)


@pytest.mark.parametrize("world", [0, -2])
def test_world_size_must_be_positive(world):
    with pytest.raises(ConfigError, match=f"world size {world} must be ≥ 1"):
        load_config(None).validate_layout(world)


def test_config_that_is_a_directory_or_not_utf8(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path} is a directory; pass a TOML file"):
        load_config(tmp_path)
    p = tmp_path / "latin1.toml"
    p.write_bytes('[data]\npath = "/données"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{p} is not UTF-8 text"):
        load_config(p)


def test_nnodes_accepts_an_int_but_other_strings_stay_strict(tmp_path):
    assert load_config(None, ["launch.nnodes=2"]).launch.nnodes == "2"
    assert load_config(write(tmp_path, "[launch]\nnnodes = 3\n")).launch.nnodes == "3"
    assert load_config(None, ['launch.nnodes="1:3"']).launch.nnodes == "1:3"
    with pytest.raises(ConfigError, match="'launch.nnodes' must be str, got True"):
        load_config(None, ["launch.nnodes=true"])
    with pytest.raises(ConfigError, match="'train.dtype' must be str, got 2"):
        load_config(None, ["train.dtype=2"])


# A wrong knob is answered before anything imports torch (minutes on a loaded host), in the
# launcher and in its early zygote: each case runs `resilient launch` in a fresh interpreter
# and reports, at the error, whether torch was imported and whether a zygote was started.
_PROBE = r"""
import json, sys
import resilient.agent.warm as warm
started = []
real_start = warm.start_early
warm.start_early = lambda *a: started.append(a) or real_start(*a)
from resilient.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "zygote": bool(started)}))
"""


@pytest.mark.parametrize("argv,words", [
    (["configs/demo.toml", "--set", "snapshot.evrey=3"], "unknown key 'snapshot.evrey'; did you mean 'snapshot.every'"),
    (["configs/demo.toml", "--set", "snapshot.every=-3"], "'snapshot.every' must be ≥ 0, got -3"),
    (["configs/demo.toml", "--set", "snapshot.durable_every=-5"], "'snapshot.durable_every' must be ≥ 0, got -5"),
    (["configs/demo.toml", "--set", "snapshot.store_keep=-1"], "'snapshot.store_keep' must be ≥ 1, got -1"),
    (["configs/demo.toml", "--set", "launch.heartbeat_timeout=-1"], "'launch.heartbeat_timeout' must be > 0"),
    (["configs/demo.toml", "--set", "train.beta2=1.5"], "'train.beta2' must be < 1"),
    (["--set", "snapshot.keep_last=0", "examples/fsdp2_train.py"], "'snapshot.keep_last' must be ≥ 1, got 0"),
])
def test_config_errors_come_before_torch_is_imported(tmp_path, argv, words):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PROBE, "launch", "--run-dir", str(tmp_path / "run"), *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"rc": 2, "torch": False, "zygote": False}, proc.stderr
    assert "resilient launch: error:" in proc.stderr and words in proc.stderr, proc.stderr
