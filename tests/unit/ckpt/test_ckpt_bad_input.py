"""Bad input to the checkpoint tools gets a typed error (exit 2) that says what to do, never a
traceback; outputs are never overwritten or left half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from resilient_tools.cli import main
from resilient_tools.errors import CkptToolError, ConvertError
from resilient_tools.importer import import_checkpoint
from resilient_tools.writer import VersionWriter


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["-q", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def ckpt(tmp_path) -> Path:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.randn(32, 16), "zeros": torch.zeros(64, dtype=torch.int64)}, src)
    import_checkpoint(str(src), str(tmp_path / "run"), "torch", step=5, compress="zstd", progress=False)
    return tmp_path / "run"


@pytest.mark.parametrize("name,data,fmt", [
    ("garbage.pt", b"hello world" * 10, "torch"),     # KeyError inside torch.load's legacy fallback
    ("noise.pt", bytes(range(256)) * 8, "torch"),
    ("empty.pt", b"", "torch"),
    ("garbage.safetensors", b"hello world" * 10, "safetensors"),  # SafetensorError: header too large
    ("empty.safetensors", b"", "safetensors"),
], ids=["garbage-torch", "noise-torch", "empty-torch", "garbage-safetensors", "empty-safetensors"])
def test_import_of_a_garbled_file_is_a_convert_error(tmp_path, capsys, name, data, fmt):
    bad = tmp_path / name
    bad.write_bytes(data)
    rc, _, err = run(capsys, "import", bad, tmp_path / "o", "--from", fmt)
    assert rc == 2 and "ConvertError" in err and name in err and "--from" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_import_refuses_a_negative_step(tmp_path, capsys):
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2)}, src)
    rc, _, err = run(capsys, "import", src, tmp_path / "o", "--from", "torch", "--step", "-1")
    assert rc == 2 and "--step" in err
    with pytest.raises(ConvertError, match="non-negative"):
        import_checkpoint(str(src), str(tmp_path / "o"), "torch", step=-1, progress=False)
    with pytest.raises(CkptToolError, match="non-negative"):
        VersionWriter(str(tmp_path / "o"), -1)
    assert not (tmp_path / "o").exists()


def test_convert_out_that_is_a_folder_or_a_file(ckpt, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    rc, _, err = run(capsys, "convert", ckpt, folder, "--format", "safetensors")
    assert rc == 2 and "OutputExists" in err and "folder" in err
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob("*.tmp-*"))
    afile = tmp_path / "afile"
    afile.write_text("precious")
    rc, _, err = run(capsys, "convert", ckpt, afile, "--format", "torch-dcp")
    assert rc == 2 and "OutputExists" in err and "is a file" in err and afile.read_text() == "precious"


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_convert_does_not_overwrite_without_force(ckpt, tmp_path, capsys, fmt):
    out = tmp_path / "out.bin"
    out.write_text("precious")
    rc, _, err = run(capsys, "convert", ckpt, out, "--format", fmt)
    assert rc == 2 and "OutputExists" in err and "--force" in err and out.read_text() == "precious"
    assert run(capsys, "convert", ckpt, out, "--format", fmt, "--force")[0] == 0
    assert out.stat().st_size > 100 and not list(tmp_path.glob("*.tmp-*"))


def test_huge_chunk_length_is_a_truncated_object_not_a_memory_error(ckpt, tmp_path, capsys):
    man = ckpt / "step-000000000005" / "manifest.json"
    m = json.loads(man.read_text())
    chunk = m["tensors"]["model/zeros"]["chunks"][0]
    assert chunk["compression"] == "zstd"  # only a compressed chunk's length is not bounded by its box
    chunk["length"] = 10 ** 13
    man.write_text(json.dumps(m))
    rc, out, _ = run(capsys, "verify", ckpt)
    assert rc == 1 and "truncated" in out
    for argv in (["diff", ckpt, ckpt], ["convert", ckpt, tmp_path / "x.st", "--format", "safetensors"],
                 ["convert", ckpt, tmp_path / "x.pt", "--format", "torch"],
                 ["reshard", ckpt, "--to", "dp=2", tmp_path / "r"]):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and "SnapshotCorrupt" in err and "truncated" in err, argv
    assert not (tmp_path / "r").exists() and not (tmp_path / "x.st").exists()


def test_s3_without_credentials_is_a_bad_url(s3_endpoint, monkeypatch, capsys, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    opts = json.dumps({"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True})
    rc, _, err = run(capsys, "--storage-options", opts, "ls", "s3://ckpt/run")
    assert rc == 2 and "BadUrl" in err and "credentials" in err and "AWS_ACCESS_KEY_ID" in err


def test_verify_of_nothing_is_no_snapshot_found(ckpt, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, out, err = run(capsys, "verify", tmp_path / "empty")
    assert rc == 2 and "NoSnapshotFound" in err and "BAD" not in out
    rc, out, err = run(capsys, "verify", f"{ckpt}@7")
    assert rc == 2 and "NoSnapshotFound" in err and "[5]" in err


def test_ls_on_a_version_folder_or_manifest_points_at_the_parent(ckpt, capsys):
    vdir = ckpt / "step-000000000005"
    for url in (vdir, vdir / "manifest.json"):
        rc, _, err = run(capsys, "ls", url)
        assert rc == 2 and "BadUrl" in err and f"'{ckpt}'" in err and f"{ckpt}@5" in err


@pytest.mark.parametrize("argv", [
    ["--threads", "0", "verify", "X"], ["--inflight-mb", "0", "verify", "X"],
    ["reshard", "X", "--to", "dp=2", "O", "--block-mb", "0"], ["reshard", "X", "--to", "dp=2", "O", "--chunk-mb", "0"],
    ["convert", "X", "O", "--format", "torch", "--block-mb", "0"], ["diff", "X", "X", "--block-mb", "0"],
    ["gc", "X", "--keep-last", "1", "--keep-every", "-1"],
])
def test_zero_sizes_and_counts_are_rejected(capsys, argv):
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and "at least" in err


def test_empty_target_layout_is_rejected(ckpt, tmp_path, capsys):
    for to in ("", " , "):
        rc, _, err = run(capsys, "reshard", ckpt, "--to", to, tmp_path / "o")
        assert rc == 2 and "LayoutError" in err and "pp=2" in err
    assert not (tmp_path / "o").exists()
