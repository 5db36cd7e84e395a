"""gc on damaged checkpoints, interrupted writers, --force, and diff's tolerance on non-finite values.

Versions are written by ``ckpt import`` (small, fast, the standard format); what matters here is
what the tools do around them, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resilient_tools.cli import main
from resilient_tools.importer import import_checkpoint
from resilient_tools.writer import VersionWriter


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["-q", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def versions(root: Path, state: dict, steps, tmp_path: Path) -> Path:
    src = tmp_path / "src.pt"
    torch.save(state, src)
    for s in steps:
        import_checkpoint(str(src), str(root), "torch", step=s, progress=False)
    return root


@pytest.fixture
def three(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    return versions(tmp_path / "run", {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
                    (4, 8, 12), tmp_path)


def manifest(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}" / "manifest.json"


def steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step-"))


def garble(path: Path) -> None:
    text = path.read_text()
    path.write_text(text[: len(text) // 2])


def test_gc_with_a_corrupt_newest_manifest_keeps_the_readable_versions(three, capsys):
    garble(manifest(three, 12))
    rc, out, _ = run(capsys, "gc", three, "--keep-last", "1", "--dry-run")
    assert rc == 0 and "would remove: [4]" in out and "kept complete: [8]" in out and "unreadable step 12" in out
    rc, out, _ = run(capsys, "gc", three, "--keep-last", "1")
    assert rc == 0 and "removed: [4]" in out
    assert steps(three) == [8, 12]  # the newest readable kept; the unreadable one left for a human to judge
    assert run(capsys, "verify", f"{three}@8")[0] == 0


def test_gc_never_deletes_the_last_readable_version(three, capsys):
    garble(manifest(three, 8))
    manifest(three, 12).write_text(manifest(three, 12).read_text().replace('"format_version":1', '"format_version":9'))
    rc, out, _ = run(capsys, "gc", three, "--keep-last", "1")
    assert rc == 0 and "removed: nothing" in out and "kept complete: [4]" in out
    assert steps(three) == [4, 8, 12]


def interrupt_after(monkeypatch, calls: int) -> None:
    """Ctrl-C in the middle of writing a version: the ``calls``-th chunk append raises KeyboardInterrupt."""
    real = VersionWriter._append
    seen = {"n": 0}

    def append(self, *a, **k):
        seen["n"] += 1
        if seen["n"] == calls:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(VersionWriter, "_append", append)


@pytest.mark.parametrize("cmd", ["reshard", "import"])
def test_interrupted_write_cleans_up_and_reruns(three, tmp_path, capsys, monkeypatch, cmd):
    out = tmp_path / "out"
    src = tmp_path / "src.pt"
    argv = ["reshard", three, "--to", "dp=2", out, "--chunk-mb", "1"] if cmd == "reshard" else \
        ["import", src, out, "--from", "torch", "--step", "3"]
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        rc, _, err = run(capsys, *argv)
    assert rc == 130 and "removed" in err and "ckpt gc" not in err
    assert not out.exists()  # nothing left that gc would keep forever or that blocks a rerun
    assert run(capsys, *argv)[0] == 0
    assert run(capsys, "verify", out)[0] == 0


def test_debris_is_reported_incomplete_and_force_replaces_it(three, tmp_path, capsys):
    out = tmp_path / "out"
    debris = out / "step-000000000012" / "0123456789ab"
    debris.mkdir(parents=True)
    (debris / "tool-p00000.bin").write_bytes(b"x" * 100)
    rc, _, err = run(capsys, "reshard", three, "--to", "dp=2", out)
    assert rc == 2 and "OutputExists" in err and "incomplete" in err and "--force" in err
    assert debris.exists()  # refusing must not delete anything
    assert run(capsys, "reshard", three, "--to", "dp=2", out, "--force")[0] == 0
    assert not debris.exists() and run(capsys, "verify", out)[0] == 0
    # a complete version is refused too, and --force replaces it with only the new attempt left
    rc, _, err = run(capsys, "reshard", three, "--to", "dp=4", out)
    assert rc == 2 and "complete version" in err
    assert run(capsys, "reshard", three, "--to", "dp=4", out, "--force")[0] == 0
    vdir = out / "step-000000000012"
    m = json.loads((vdir / "manifest.json").read_text())
    assert m["layout"]["dp"] == 4 and sorted(p.name for p in vdir.iterdir()) == sorted(["manifest.json", m["attempt"]])
    assert run(capsys, "verify", out)[0] == 0


def test_diff_tolerance_treats_equal_infinities_and_shared_nans_as_close(tmp_path, capsys):
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([inf, -inf, nan, 1.0, 2.0])
    versions(tmp_path / "a", {"w": a}, (1,), tmp_path)
    versions(tmp_path / "b", {"w": a + torch.tensor([0, 0, 0, 0, 1e-6])}, (1,), tmp_path)
    versions(tmp_path / "c", {"w": torch.tensor([inf, 5.0, nan, 1.0, 2.0])}, (1,), tmp_path)
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--atol", "1e-4", "--json")
    r = json.loads(out)
    assert rc == 0 and r["match"] and r["tensors"][0]["status"] == "close"
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--rtol", "1e-3")
    assert rc == 0 and "MATCH (within tolerance)" in out
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "c", "--atol", "1e-4", "--rtol", "1")
    assert rc == 1 and "differ" in out  # -inf vs 5: an infinite difference is never within tolerance
    rc, out, _ = run(capsys, "diff", tmp_path / "c", tmp_path / "a", "--atol", "1e-4", "--rtol", "1")
    assert rc == 1 and "differ" in out  # 5 vs -inf: rtol * |inf| must not excuse it either


def test_interrupt_after_the_manifest_landed_keeps_the_version(three, tmp_path, capsys, monkeypatch):
    """Ctrl-C between writing the manifest and returning: abort must not delete the objects it names."""
    import resilient_tools.writer as writer

    real = writer.write_object

    def write_then_interrupt(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt
    monkeypatch.setattr(writer, "write_object", write_then_interrupt)
    out = tmp_path / "out"
    assert run(capsys, "reshard", three, "--to", "dp=2", out)[0] == 130
    monkeypatch.undo()
    assert run(capsys, "verify", out)[0] == 0
