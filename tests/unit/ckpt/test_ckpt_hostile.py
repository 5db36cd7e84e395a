"""Hostile checkpoints in bounded memory (issue 39, item 5): a small zstd frame whose
consistent manifest claims gigabytes is refused before anything is allocated (it took
``ckpt verify/convert/reshard`` to 2.4 GB of RSS); malformed manifests (sizes, offsets,
compression) end in typed problems, never in a big allocation or an untyped error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from resilient.snapshot import Snapshotter

GiB = 1 << 30


def _bomb(root) -> None:
    """Version 1: one float32 tensor of 2 GiB as one zstd chunk of zeros (~65 KiB stored), with a
    manifest that agrees with itself (shape, sizes, raw_length, the frame's own content size)."""
    import zstandard

    from resilient.snapshot.api import ChunkRecord, Manifest, TensorRecord
    from resilient.snapshot.format import checksum, manifest_to_json, version_dir

    n = 2 * GiB
    comp = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=n)
    zero = bytes(1 << 20)
    frame = b"".join(comp.compress(zero) for _ in range(n >> 20)) + comp.flush()
    vdir = root / version_dir(1)
    (vdir / "att").mkdir(parents=True)
    (vdir / "att" / "p.bin").write_bytes(frame)
    chunk = ChunkRecord("att/p.bin", 0, len(frame), n, (0,), (n // 4,), checksum(frame), "zstd")
    m = Manifest(step=1, world=1, layout={"world": 1}, config_digest="", attempt="att",
                 tensors={"model/bomb": TensorRecord("model/bomb", (n // 4,), "float32", [chunk])})
    (vdir / "manifest.json").write_bytes(manifest_to_json(m))


def _cap_address_space() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression fails here, not the host


def _peak_rss(argv: list[str]) -> tuple[int, int, str]:
    """Exit code, peak RSS (bytes) and output of ``resilient ckpt ARGV`` in a child process."""
    p = subprocess.Popen([sys.executable, "-m", "resilient.cli", "ckpt", "-q", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_cap_address_space)
    out, err = p.stdout.read(), p.stderr.read()  # small: a line or two
    _, status, usage = os.wait4(p.pid, 0)  # this child's own peak, not the children's maximum
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, out + err


def test_a_decompression_bomb_is_refused_before_it_is_inflated(tmp_path):
    _bomb(tmp_path / "ckpt")
    for argv in (["verify", str(tmp_path / "ckpt")],
                 ["convert", str(tmp_path / "ckpt"), str(tmp_path / "x.st"), "--format", "safetensors"],
                 ["reshard", str(tmp_path / "ckpt"), "--to", "dp=2", str(tmp_path / "r")]):
        rc, peak, text = _peak_rss(argv)
        assert rc in (1, 2) and "claims 2147483648 bytes" in text, (argv, text[-2000:])
        assert peak < GiB, f"{argv[0]} peaked at {peak / 2**20:.0f} MiB on a 65 KiB frame"
    assert not (tmp_path / "x.st").exists() and not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small sound version: a zstd-compressed bf16 tensor and a raw fp32 one."""
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    g = torch.Generator().manual_seed(0)
    state = {"model": {"h": torch.zeros(64, 32, dtype=torch.bfloat16), "w": torch.randn(16, 8, generator=g)}}
    with Snapshotter(root.as_uri(), secret=None, compress="zstd") as snap:
        snap.save(1, state, force=True)
    return root, (root / "step-000000000001" / "manifest.json").read_text()


FIELDS = ("length", "raw_length", "offset", "sizes", "offsets", "compression", "shape")
HUGE = st.sampled_from([0, 1, -1, 7, 2 ** 31, 2 ** 40, 2 ** 62, 2 ** 64])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensor=st.sampled_from(["model/h", "model/w"]), field=st.sampled_from(FIELDS), value=HUGE,
       consistent=st.booleans())
def test_malformed_manifests_give_typed_problems_in_bounded_memory(base, tensor, field, value, consistent):
    from resilient_tools.verify import verify

    root, pristine = base
    doc = json.loads(pristine)
    t = doc["tensors"][tensor]
    c = t["chunks"][0]
    if field == "compression":
        c["compression"] = ["zstd", "none", "lz4", ""][value % 4] if value >= 0 else 5
    elif field in ("sizes", "offsets"):
        c[field] = [value] + c[field][1:]
    elif field == "shape":
        t["shape"] = [value] + t["shape"][1:]
    else:
        c[field] = value
    if consistent and field in ("sizes", "shape") and value > 0:  # make the claim agree with itself
        t["shape"][0] = c["sizes"][0] = value
        item = 2 if t["dtype"] == "bfloat16" else 4
        c["raw_length"] = value * item * (t["shape"][1] if len(t["shape"]) > 1 else 1)
        if c["compression"] == "none":
            c["length"] = c["raw_length"]
    man = root / "step-000000000001" / "manifest.json"
    man.write_text(json.dumps(doc))
    tracemalloc.start()
    try:
        report = verify(str(root), progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        man.write_text(pristine)
    assert peak < 64 << 20, f"{field}={value}: {peak / 2**20:.0f} MiB"
    assert report.ok or all(p.problem for p in report.problems)


def _dcp(tmp_path, edit) -> str:
    """A real DCP folder whose ``.metadata`` ``edit(meta)`` crafts (written back as DCP writes it)."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from resilient_tools.importer import read_dcp_metadata

    folder = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model.w": torch.randn(4, 4)}, checkpoint_id=folder)
    meta = read_dcp_metadata(folder)
    edit(meta)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    return folder


def test_a_dcp_path_climbing_out_of_its_folder_is_refused(tmp_path, capsys):
    import dataclasses

    from resilient_tools.cli import main as ckpt

    def escape(meta):
        for k, info in list(meta.storage_data.items()):
            meta.storage_data[k] = dataclasses.replace(info, relative_path="../../../../../../etc/passwd")

    folder = _dcp(tmp_path, escape)
    assert ckpt(["-q", "import", folder, str(tmp_path / "out"), "--from", "torch-dcp"]) == 2
    err = capsys.readouterr().err
    assert "ConvertError" in err and "outside the checkpoint folder" in err
    assert not (tmp_path / "out").exists()


def test_a_dcp_tensor_claiming_a_tebibyte_is_a_typed_error(tmp_path, capsys):
    import dataclasses

    from resilient_tools.cli import main as ckpt

    def huge(meta):
        v = meta.state_dict_metadata["model.w"]
        meta.state_dict_metadata["model.w"] = dataclasses.replace(v, size=torch.Size([1 << 38, 1]))  # 1 TiB fp32

    folder = _dcp(tmp_path, huge)
    assert ckpt(["-q", "import", folder, str(tmp_path / "out"), "--from", "torch-dcp"]) == 2
    err = capsys.readouterr().err
    assert "ConvertError" in err and "GiB" in err and "Traceback" not in err


def test_a_tensor_claimed_beyond_its_stored_bytes_or_this_hosts_memory_is_a_typed_error(tmp_path):
    """``ckpt convert --format torch`` holds whole tensors: a manifest that claims 8 TiB of stored
    bytes in a 512-byte object, or 32 GiB in compressed chunks (each within the inflate cap) of a
    tiny frame, ends in a typed error before anything of that size is allocated or read."""
    root = tmp_path / "ckpt"
    with Snapshotter(root.as_uri(), secret=None, compress="none") as snap:
        snap.save(1, {"model": {"w": torch.randn(16, 8)}}, force=True)
    man = root / "step-000000000001" / "manifest.json"
    pristine = json.loads(man.read_text())
    for claim in ("stored", "inflated"):
        doc = json.loads(json.dumps(pristine))
        t = doc["tensors"]["model/w"]
        c = t["chunks"][0]
        if claim == "stored":   # uncompressed: 2^38 rows of 8 float32 in the same 512-byte object
            t["shape"], c["sizes"] = [1 << 38, 8], [1 << 38, 8]
            c["raw_length"] = c["length"] = (1 << 38) * 32
        else:                   # 32 chunks of 2^25 rows (1 GiB raw each), all the object's first bytes
            rows = 1 << 25
            t["shape"] = [32 * rows, 8]
            t["chunks"] = [{**c, "offsets": [i * rows, 0], "sizes": [rows, 8], "raw_length": rows * 32,
                            "length": 16, "compression": "zstd"} for i in range(32)]
        man.write_text(json.dumps(doc))
        rc, peak, text = _peak_rss(["convert", str(root), str(tmp_path / f"{claim}.pt"), "--format", "torch"])
        assert rc == 2 and "Traceback" not in text, (claim, text[-2000:])
        assert ("object is truncated" if claim == "stored" else "more than this host can allocate") in text, text
        assert peak < GiB, f"{claim}: peaked at {peak / 2**20:.0f} MiB"
        assert not (tmp_path / f"{claim}.pt").exists()
