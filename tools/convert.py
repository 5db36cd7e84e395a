"""``ckpt convert``: consolidated weights for the rest of the ecosystem.

Formats and their memory bound (be honest, checkpoints outgrow RAM):

- ``safetensors``: streamed. The header needs every tensor's offset up
  front; those come from the manifest (shapes and dtypes), so the header is
  written first and then each tensor's bytes, assembled row block by row
  block. Peak memory: one block (64 MiB) plus chunks in flight.
- ``torch-dcp``: a ``torch.distributed.checkpoint`` directory (FileSystemWriter,
  no process group). DCP's ``save`` wants the whole state dict of tensors, so
  the tensors are first streamed into a staging file next to the output and
  handed to DCP as memory-mapped (file-backed) tensors: anonymous memory stays
  at a block, page cache holds the rest and is reclaimable; the staging file
  needs disk space equal to the model until DCP has written (then it is removed).
  Local output folders only (torch's fsspec writer is private).
- ``torch``: ``torch.save`` of a dict; it needs RAM for the whole selection.

Names: model tensors lose their ``model/`` prefix (``layers.0.attention.wq.weight``,
what ``model.load_state_dict`` wants); with ``optimizer`` the optimizer
state is added under its stored name (``optim/<param>/<key>`` as the runtime
writes it, ``optim/state/<param>/<key>`` for a saved ``get_state_dict`` dict)
for safetensors and torch, or DCP's own flattening of it
(``optim.<param>.<key>`` / ``optim.state.<param>.<key>``) with ``model.<param>``.

An existing OUT is never overwritten without ``force`` (and then atomically,
on a local disk: the old file stays until the new one is complete).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from typing import Iterator

import numpy as np
import torch

from resilient.snapshot.api import TensorRecord
from resilient.snapshot.format import dtype_from_name

from resilient_tools.blocks import BlockBuffer, itemsize, read_blocks, tensor_bytes
from resilient_tools.errors import ConvertError, OutputExists
from resilient_tools.progress import Progress
from resilient_tools.source import Source

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


def select(src: Source, optimizer: bool, dcp_names: bool = False) -> list[tuple[str, TensorRecord]]:
    """(output name, record) of the tensors to export, in manifest order.

    Model tensors are those under ``model/``; a state without that group
    exports every non-optimizer tensor under its own name."""
    m = src.manifest
    has_model = any(n.startswith("model/") for n in m.tensors)
    out = []
    for name, rec in m.tensors.items():
        if name.startswith("optim/"):
            if optimizer:
                out.append((_dcp_name(name) if dcp_names else name, rec))
        elif name.startswith("model/"):
            key = name[len("model/"):]
            out.append((("model." + key) if (dcp_names and optimizer) else key, rec))
        elif not has_model:
            out.append((name, rec))
    if not out:
        raise ConvertError(f"{src.url} step {m.step}: no tensors to export (no 'model/' tensors"
                           f"{'' if optimizer else '; add --optimizer for the optimizer state'})")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ConvertError(f"{src.url}: exported names collide ({sorted(n for n in names if names.count(n) > 1)[:3]})")
    return out


def _dcp_name(name: str) -> str:
    """Our name as DCP flattens the nested dict: ``optim/state/layers.0.w.weight/exp_avg`` ->
    ``optim.state.layers.0.w.weight.exp_avg``, the runtime's ``optim/layers.0.w.weight/exp_avg`` ->
    ``optim.layers.0.w.weight.exp_avg`` (``importer._from_dcp_name`` inverts both)."""
    return ".".join(p.replace("~1", "/").replace("~0", "~") for p in name.split("/"))


def _stream(src: Source, rec: TensorRecord, buf: BlockBuffer, bar: Progress) -> Iterator[memoryview]:
    for _, values in read_blocks(src.reader, src.manifest, rec, buf):
        data = tensor_bytes(values)
        yield data
        bar.advance(len(data))


def _check_out(path: str, force: bool):
    """(fs, path) of a one-file OUT; OutputExists for a folder, or an existing file without ``force``."""
    import fsspec
    from resilient_tools.source import STORAGE_OPTIONS
    fs, p = fsspec.core.url_to_fs(path, **STORAGE_OPTIONS)
    if fs.isdir(p):
        raise OutputExists(f"{path}: is a folder; safetensors and torch write one file: give a file path, "
                           f"e.g. {path.rstrip('/')}/model.safetensors")
    if fs.exists(p) and not force:
        raise OutputExists(f"{path}: already exists; choose another OUT, or pass --force to replace it")
    return fs, p


def _open_out(path: str, force: bool = False):
    """(file object, finish(ok)) writing ``path`` atomically on a local disk, as a stream elsewhere.

    Refuses a folder, and an existing file unless ``force``, before anything is written."""
    from fsspec.implementations.local import LocalFileSystem
    fs, p = _check_out(path, force)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{p}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
            f = open(tmp, "wb")
        except OSError as e:
            raise ConvertError(f"{path}: cannot write there ({type(e).__name__}: {e}); check the path") from None

        def finish(ok: bool) -> None:
            try:
                f.close()
                if ok:
                    os.replace(tmp, p)
            finally:
                if os.path.exists(tmp):  # not replaced (failed, interrupted): never leave it behind
                    os.unlink(tmp)
        return f, finish
    f = fs.open(p, "wb")
    return f, lambda ok: f.close()


def to_safetensors(src: Source, out: str, optimizer: bool = False, block_bytes: int = 32 << 20,
                   progress: bool = True, force: bool = False) -> int:
    """Write one ``.safetensors`` file; returns its size in bytes."""
    items = select(src, optimizer)
    header: dict = {"__metadata__": {"format": "pt", "resilient_step": str(src.step),
                                     "resilient_source": src.url}}
    offset = 0
    for name, rec in items:
        dtype = dtype_from_name(rec.dtype, name)
        if dtype not in SAFETENSORS_DTYPES:
            raise ConvertError(f"{name}: dtype {rec.dtype} has no safetensors equivalent; export without it")
        n = rec.numel * itemsize(dtype)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(rec.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    bar = Progress(f"convert step {src.step} -> safetensors", offset, progress)
    f, finish = _open_out(out, force)
    ok = False
    try:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        buf = BlockBuffer(block_bytes)
        for _, rec in items:
            for data in _stream(src, rec, buf, bar):
                f.write(data)
        ok = True
    finally:
        finish(ok)
    bar.close()
    return 8 + len(head) + offset


def to_torch(src: Source, out: str, optimizer: bool = False, progress: bool = True, force: bool = False) -> int:
    """``torch.save`` of ``{name: tensor}``: holds the whole selection in RAM (torch.save needs it)."""
    items = select(src, optimizer)
    _check_out(out, force)  # refuse a bad OUT before reading the whole selection into RAM
    bar = Progress(f"convert step {src.step} -> torch (in RAM)", sum(r.numel * itemsize(
        dtype_from_name(r.dtype, n)) for n, r in items), progress)
    state = {}
    for name, rec in items:
        state[name] = src.reader.read_region(src.manifest, rec.name)
        bar.advance(state[name].numel() * state[name].element_size())
    f, finish = _open_out(out, force)
    ok = False
    try:
        torch.save(state, f)
        ok = True
    finally:
        finish(ok)
    bar.close()
    return os.path.getsize(out) if os.path.exists(out) else 0


_NP = {torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8, torch.float8_e5m2: np.uint8}


def _mapped(path: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor backed by bytes ``offset..`` of ``path`` (file-backed pages, not anonymous memory)."""
    npdt = _NP.get(dtype) or torch.empty((), dtype=dtype).numpy().dtype
    n = 1
    for s in shape:
        n *= s
    arr = np.memmap(path, dtype=npdt, mode="r+", offset=offset, shape=(max(n, 1),))
    t = torch.from_numpy(arr)
    if dtype in _NP:
        t = t.view(dtype)
    return t[:n].view(shape)


def to_dcp(src: Source, out: str, optimizer: bool = False, block_bytes: int = 32 << 20,
           progress: bool = True, force: bool = False) -> int:
    """A DCP checkpoint directory at ``out`` (local); returns bytes of tensors written."""
    import torch.distributed.checkpoint as dcp
    if "://" in out and not out.startswith("file://"):
        raise ConvertError(f"{out}: torch-dcp output must be a local folder (torch's fsspec writer is private); "
                           "convert locally, then copy the folder")
    out = out.removeprefix("file://")
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExists(f"{out}: is a file; torch-dcp writes a folder: choose another OUT")
    if os.path.exists(os.path.join(out, ".metadata")) and not force:
        raise OutputExists(f"{out}: already holds a DCP checkpoint (.metadata); choose another folder, or pass "
                           "--force to overwrite it")
    items = select(src, optimizer, dcp_names=True)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConvertError(f"{out}: cannot create the folder ({type(e).__name__}: {e}); check the path") from None
    sizes = [r.numel * itemsize(dtype_from_name(r.dtype, n)) for n, r in items]
    stage = os.path.join(out, f".staging-{uuid.uuid4().hex[:8]}.raw")
    bar = Progress(f"convert step {src.step} -> torch-dcp (staging)", sum(sizes), progress)
    try:
        offsets, at = [], 0
        with open(stage, "wb") as f:
            buf = BlockBuffer(block_bytes)
            for (name, rec), n in zip(items, sizes):
                offsets.append(at)
                for data in _stream(src, rec, buf, bar):
                    f.write(data)
                at += max(n, itemsize(dtype_from_name(rec.dtype, name)))
                f.seek(at)
            f.truncate(at)
        bar.close()
        state = {name: _mapped(stage, off, dtype_from_name(rec.dtype, name), rec.shape)
                 for (name, rec), off in zip(items, offsets)}
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: single-process save"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(out))
        del state
    finally:
        if os.path.exists(stage):
            os.unlink(stage)
    return sum(sizes)
