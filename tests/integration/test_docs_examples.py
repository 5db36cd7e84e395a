"""Examples are tests (issue 44): every block of README.md and docs/*.md a user is meant to type
runs here as typed, on loopback (a real etcd, the demo made small; :mod:`docblocks` says what
is filled in), or is marked illustrative in the file with its reason."""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from docblocks import DEMO_SMALL, BlockFailed, blocks, copy_env, doc_files, run_block
from launchutil import REPO
from resilient_chaos.etcd_testing import embedded_etcd, unique_run_id

ALL = [b for f in doc_files(REPO) for b in blocks(f)]
RUN = [b for b in ALL if b.illustrative is None]

TRAIN_PY = textwrap.dedent("""\
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t)
    print("rank", dist.get_rank(), "sum", t.item())
""")  # no destroy_process_group(), as in many users' scripts: it must end cleanly all the same


def _small_demo() -> str:
    text = (REPO / "configs" / "demo.toml").read_text()
    for key, value in DEMO_SMALL.items():
        section, name = key.split(".")
        body = re.search(rf"(?ms)^\[{section}\]\n(.*?)(?=^\[|\Z)", text)
        assert body, f"configs/demo.toml has no [{section}]"
        new, n = re.subn(rf"(?m)^{name}\s*=.*$", f"{name} = {value}", body.group(1))
        text = text.replace(body.group(1), new if n else body.group(1) + f"{name} = {value}\n")
    return text


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    """A folder like a checkout (examples/, chaos/, bench/ linked to the repo's), whose
    configs/demo.toml is the demo made small, plus train.py; and a real etcd."""
    cwd = tmp_path_factory.mktemp("docs")
    for name in ("examples", "chaos", "bench", "scripts", "deploy"):
        (cwd / name).symlink_to(REPO / name)
    (cwd / "configs").mkdir()
    for conf in (REPO / "configs").iterdir():
        (cwd / "configs" / conf.name).symlink_to(conf)
    (cwd / "configs" / "demo.toml").unlink()
    (cwd / "configs" / "demo.toml").write_text(_small_demo())
    (cwd / "train.py").write_text(TRAIN_PY)
    with embedded_etcd() as etcd:
        yield cwd, etcd.endpoint
    shutil.rmtree(cwd, ignore_errors=True)


def _run(block, cwd: Path, endpoint: str) -> str:
    # TMPDIR: what the blocks leave in the temp dir (torchrun's /tmp/torchelastic_* log dirs) goes
    # with the test's folder.
    env = copy_env({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(cwd),
                    "PATH": f"{Path(sys.executable).parent}:{__import__('os').environ['PATH']}"})
    return run_block(block, cwd, env, timeout_s=240, endpoint=endpoint, run_id=unique_run_id("docs"),
                     tmp=str(cwd))


def test_every_typed_block_is_run_or_says_why_not():
    assert RUN, "no runnable block found: the extractor is broken"
    for block in ALL:
        assert block.illustrative is None or len(block.illustrative) > 8, f"{block.where}: say why it is not run"


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUN, ids=[f"{b.file.name}:{b.line}" for b in RUN])
def test_block_runs_as_typed(block, where):
    cwd, endpoint = where
    # Each block as on a fresh checkout: another block's run dir (the demo at another size) would
    # be resumed, and refused as a checkpoint of another model.
    shutil.rmtree(cwd / "runs", ignore_errors=True)
    _run(block, cwd, endpoint)


@pytest.mark.etcd
def test_a_broken_block_is_reported_with_its_file_and_line(tmp_path, where):
    cwd, endpoint = where
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    assert "\nresilient config --explain " in text  # the line that starts the Configs block
    readme.write_text(text.replace("\nresilient config --explain ", "\nresilient config --explian ", 1))
    (broken,) = [b for b in blocks(readme) if "--explian" in b.text]
    with pytest.raises(BlockFailed) as failed:
        _run(broken, cwd, endpoint)
    line = next(i for i, s in enumerate(readme.read_text().splitlines(), 1) if "--explian" in s)
    assert broken.line < line and str(failed.value).startswith(f"{readme}:{broken.line}: exit 2"), str(failed.value)
    assert "--explian" in str(failed.value)
