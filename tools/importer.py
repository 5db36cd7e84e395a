"""``ckpt import``: bring a safetensors file, a torch checkpoint or a DCP folder into our format.

Nothing arbitrary is ever unpickled:

- ``torch``: ``torch.load(weights_only=True, mmap=True)`` (tensors, dicts,
  lists and plain values only; memory-mapped, so tensors page in as they are
  written; a legacy non-zip file cannot be mapped and is loaded whole).
- ``torch-dcp``: DCP's ``.metadata`` is a pickle; it is read with an
  unpickler that admits an explicit list of DCP's metadata classes,
  ``torch.Size`` and dtypes, by exact name (anything else is
  :class:`UnsafeCheckpoint`); tensors are then loaded one at a time
  with ``dcp.load`` (no process group): memory is the largest tensor.
- ``safetensors``: header parsed by the package; tensors read in row blocks.

Names: ``model/``/``optim/`` prefixed names are kept; other names become
``model/<name>``; DCP's ``model.X`` / ``optim.state.P.K`` / ``optim.P.K``
become ``model/X`` / ``optim/state/P/K`` / ``optim/P/K`` (the last is the
runtime's naming, so a runtime checkpoint survives a DCP round trip).
Non-tensor entries become manifest ``values`` when they are JSON.

Bad input (a garbled or empty file, the wrong ``--from``) is a
:class:`ConvertError` naming the file, never a library's traceback.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from resilient.snapshot.boxes import Box
from resilient.snapshot.flatten import escape, split_state

from resilient_tools.blocks import itemsize, row_blocks
from resilient_tools.errors import ConvertError, UnsafeCheckpoint
from resilient_tools.progress import Progress
from resilient_tools.writer import VersionWriter

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


def our_name(name: str) -> str:
    return name if name.startswith(("model/", "optim/")) else f"model/{name}"


def _write_tensor(w: VersionWriter, name: str, t: torch.Tensor, block_bytes: int, bar: Progress) -> None:
    w.add_tensor(name, tuple(t.shape), t.dtype)
    for box in row_blocks(tuple(t.shape), itemsize(t.dtype), block_bytes):
        w.write(name, box, t[box.slices_within(Box((0,) * t.dim(), tuple(t.shape)))])
        bar.advance(box.numel * itemsize(t.dtype))


def from_safetensors(path: str, w: VersionWriter, block_bytes: int, progress: bool) -> int:
    from safetensors import SafetensorError
    try:
        return _from_safetensors(path, w, block_bytes, progress)
    except SafetensorError as e:  # a garbled, empty or truncated file: the package's own error type
        raise ConvertError(f"{path}: not a readable safetensors file ({e}); check the file, or the --from "
                           "format (torch, torch-dcp)") from None


def _from_safetensors(path: str, w: VersionWriter, block_bytes: int, progress: bool) -> int:
    from safetensors import safe_open
    local = path.removeprefix("file://")
    with safe_open(local, framework="pt") as f:
        keys = list(f.keys())
        metas = []
        for k in keys:
            sl = f.get_slice(k)
            dtype = _ST_DTYPES.get(sl.get_dtype())
            if dtype is None:
                raise ConvertError(f"{path}: tensor {k!r} has dtype {sl.get_dtype()} which the format cannot store")
            metas.append((k, tuple(sl.get_shape()), dtype))
        bar = Progress(f"import {os.path.basename(local)}", sum(_nbytes(s, d) for _, s, d in metas), progress)
        for k, shape, dtype in metas:
            name = our_name(k)
            w.add_tensor(name, shape, dtype)
            sl = f.get_slice(k)
            if not shape:
                w.write(name, Box((), ()), f.get_tensor(k))
                bar.advance(itemsize(dtype))
                continue
            row = max(1, block_bytes // max(1, _nbytes(shape[1:], dtype)))
            for r in range(0, shape[0], row):
                n = min(row, shape[0] - r)
                w.write(name, Box((r,) + (0,) * (len(shape) - 1), (n,) + shape[1:]), sl[r:r + n])
                bar.advance(_nbytes((n,) + shape[1:], dtype))
    bar.close()
    return len(keys)


def _nbytes(shape, dtype) -> int:
    n = itemsize(dtype)
    for s in shape:
        n *= s
    return n


def _load_torch(path: str, local: str) -> Any:
    """``torch.load(weights_only=True)``, memory-mapped when the file allows; any failure is a ConvertError.

    A garbled file fails in many ways (UnpicklingError, KeyError, EOFError,
    RuntimeError, ... depending on its first bytes), so every ``Exception`` of
    the load is bad input here; only a refused global means "real objects"."""
    try:
        try:
            return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
        return torch.load(local, map_location="cpu", weights_only=True)  # legacy format: cannot be mapped
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise ConvertError(f"{path}: holds objects beyond tensors and plain containers, which are never "
                               f"unpickled here ({_first_line(e)}); re-save it as a dict of tensors") from None
        raise ConvertError(f"{path}: not a torch checkpoint (the pickle does not decode: {_first_line(e)}); check "
                           "the file, or the --from format (safetensors, torch-dcp)") from None
    except Exception as e:  # noqa: BLE001 -- see the docstring
        raise ConvertError(f"{path}: not a loadable torch checkpoint ({type(e).__name__}: {_first_line(e)}); check "
                           "the file, or the --from format (safetensors, torch-dcp)") from None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # torch's weights_only message buries the reason ("Unsupported operand 103") in paragraphs of advice
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation", "In PyTorch 2.6")
    why = next((ln for ln in lines if "Unsupported" in ln), None) or next(
        (ln for ln in lines if not ln.startswith(advice)), lines[0] if lines else "")
    return why[:200]


def from_torch(path: str, w: VersionWriter, block_bytes: int, progress: bool) -> int:
    local = path.removeprefix("file://")
    obj = _load_torch(path, local)
    if isinstance(obj, torch.Tensor) or not isinstance(obj, dict):
        raise ConvertError(f"{path}: expected a dict of tensors (a state dict), got {type(obj).__name__}")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):  # a flat state dict (what convert writes)
        tensors, values = {our_name(str(k)): v for k, v in obj.items()}, {}
    else:
        if not (set(obj) & {"model", "optim"}):
            obj = {"model": obj}
        try:
            tensors, values = split_state(obj)
        except TypeError as e:
            raise ConvertError(f"{path}: {e}") from None
    w.manifest.values.update(values)
    bar = Progress(f"import {os.path.basename(local)}", sum(t.numel() * t.element_size() for t in tensors.values()),
                   progress)
    for name, t in tensors.items():
        _write_tensor(w, name, t, block_bytes, bar)
    bar.close()
    return len(tensors)


# Every global DCP's ``.metadata`` may name, exactly (module, name): listed from the
# pickles torch 2.13's ``dcp.save`` writes (every dtype, both memory formats) plus
# the two names DCP of torch <= 2.2 wrote. Nothing is resolved by walking a dotted
# name or importing a module the pickle names: a name is found in this table or
# refused, so a crafted ``.metadata`` cannot reach ``os.system`` through a module
# that happens to import ``os``. Paths resolve to pure paths (a Windows-written
# checkpoint_id must not fail on Linux; nothing here touches the filesystem).
_DCP_NAMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "collections": ("OrderedDict",),
}
_PURE_PATHS = {"PosixPath": "PurePosixPath", "PurePosixPath": "PurePosixPath",
               "WindowsPath": "PureWindowsPath", "PureWindowsPath": "PureWindowsPath"}
_allowed: dict[tuple[str, str], Any] = {}


def _dcp_allowed() -> dict[tuple[str, str], Any]:
    """The table behind :class:`_MetadataUnpickler`, built once from modules this file imports itself."""
    if not _allowed:
        import collections
        import pathlib

        import torch.distributed._shard.sharded_tensor.metadata as old_meta
        import torch.distributed.checkpoint.filesystem as dcp_fs
        import torch.distributed.checkpoint.metadata as dcp_meta
        import torch.serialization as serialization
        modules = {"torch.distributed.checkpoint.metadata": dcp_meta, "torch.distributed.checkpoint.filesystem": dcp_fs,
                   "torch.distributed._shard.sharded_tensor.metadata": old_meta, "torch": torch,
                   "torch.serialization": serialization, "collections": collections}
        table = {(m, n): getattr(modules[m], n) for m, names in _DCP_NAMES.items() for n in names
                 if hasattr(modules[m], n)}
        table.update({("pathlib", n): getattr(pathlib, pure) for n, pure in _PURE_PATHS.items()})
        table.update({("torch", n): v for n, v in vars(torch).items()
                      if isinstance(v, (torch.dtype, torch.layout, torch.memory_format))})
        _allowed.update(table)
    return _allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals in :data:`_DCP_NAMES` (and torch's dtypes, layouts, memory formats) by exact name.

    ``find_class`` is the only way a pickle reaches a global (GLOBAL,
    STACK_GLOBAL, INST, OBJ and the EXT codes all go through it), so a refusal
    here means nothing outside the table is ever imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_allowed().get((module, name))
        if found is None:
            raise UnsafeCheckpoint(f"DCP metadata refers to {module}.{name}, which is not one of the classes DCP "
                                   "metadata is made of; refusing to unpickle it (a crafted .metadata runs code "
                                   "this way). If torch's own dcp.save wrote it, load it with torch, torch.save "
                                   "the state dict and import that with --from torch")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("DCP metadata holds a persistent reference, which DCP never writes; refusing it")


def read_dcp_metadata(folder: str):
    path = os.path.join(folder, ".metadata")
    if not os.path.exists(path):
        raise ConvertError(f"{folder}: no .metadata; not a torch.distributed.checkpoint folder")
    from torch.distributed.checkpoint.metadata import Metadata
    with open(path, "rb") as f:
        try:
            meta = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except UnsafeCheckpoint as e:
            raise UnsafeCheckpoint(f"{path}: {e}") from None
        except Exception as e:  # noqa: BLE001 -- a garbled pickle fails in many ways; all are bad input
            raise ConvertError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata):
        raise ConvertError(f"{path}: holds a {type(meta).__name__}, not DCP metadata; not a DCP folder")
    return meta


def _from_dcp_name(key: str) -> str:
    """DCP's dotted key back to our name (the inverse of ``convert._dcp_name``).

    Parameter names keep their dots, so the optimizer key is the last dotted
    part (``exp_avg``, ``step``, ``momentum_buffer``: none holds a dot).
    ``optim.state.P.K`` is a saved ``get_state_dict`` dict, ``optim.P.K`` the
    runtime's naming; both are kept as they were."""
    if key.startswith("optim."):
        rest = key[len("optim."):]
        if rest.startswith("param_groups."):
            index, _, k = rest[len("param_groups."):].partition(".")
            return "/".join(["optim", "param_groups", escape(index)] + ([escape(k)] if k else []))
        head = ["optim"]
        if rest.startswith("state."):
            head, rest = ["optim", "state"], rest[len("state."):]
        param, _, k = rest.rpartition(".")
        return "/".join(head + ([escape(param)] if param else []) + [escape(k)])
    if key.startswith("model."):
        return f"model/{escape(key[len('model.'):])}"
    return our_name(key)


def check_dcp_storage(folder: str, meta) -> None:
    """Every file DCP's metadata names lies inside ``folder`` (a ``relative_path`` climbing out
    opened ``../../etc/passwd``), and every byte range is a sane one: :class:`ConvertError` else."""
    root = os.path.realpath(folder)
    for index, info in (getattr(meta, "storage_data", None) or {}).items():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\0" in rel:
            raise ConvertError(f"{folder}/.metadata: {getattr(index, 'fqn', index)!r} names the file {rel!r}, not a "
                               "relative path inside the checkpoint folder; refusing it")
        real = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([root, real]) != root:
            raise ConvertError(f"{folder}/.metadata: {getattr(index, 'fqn', index)!r} names {rel!r}, which lies "
                               "outside the checkpoint folder (crafted metadata); refusing to open it")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, length)):
            raise ConvertError(f"{folder}/.metadata: {getattr(index, 'fqn', index)!r} has the byte range "
                               f"{offset!r}+{length!r}; the metadata is damaged")


def _empty_for_import(folder: str, key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The tensor a DCP entry is loaded into, allocated only once its size is one this machine
    can hold (a crafted entry claiming 1 TiB ended in an allocator error)."""
    import psutil

    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ConvertError(f"{folder}/.metadata: {key!r} has the shape {list(shape)}; the metadata is damaged")
    need, free = _nbytes(shape, dtype), psutil.virtual_memory().available
    if need > free:
        raise ConvertError(f"{folder}: {key!r} is {list(shape)} {dtype} ({need / 2**30:,.1f} GiB), more than this "
                           f"machine has free ({free / 2**30:,.1f} GiB): import loads one tensor at a time; import "
                           "on a bigger machine (or the metadata is crafted)")
    try:
        return torch.empty(shape, dtype=dtype)
    except RuntimeError as e:  # the allocator's refusal
        raise ConvertError(f"{folder}: cannot allocate {key!r} ({need / 2**30:,.1f} GiB): {e}") from None


def from_dcp(path: str, w: VersionWriter, block_bytes: int, progress: bool) -> int:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    folder = path.removeprefix("file://")
    meta = read_dcp_metadata(folder)

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            return meta

    check_dcp_storage(folder, meta)
    items = [(k, v) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    skipped = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    bar = Progress(f"import {folder}", sum(_nbytes(v.size, v.properties.dtype) for _, v in items), progress)
    for key, v in items:
        t = _empty_for_import(folder, key, tuple(v.size), v.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({key: t}, storage_reader=SafeReader(folder))
        _write_tensor(w, _from_dcp_name(key), t, block_bytes, bar)
        del t
    bar.close()
    if skipped:
        w.manifest.values["import/skipped_non_tensor"] = skipped
    return len(items)


def import_checkpoint(src: str, out: str, fmt: str, *, step: int = 0, block_bytes: int = 32 << 20,
                      compress: str = "auto", progress: bool = True, force: bool = False) -> tuple[str, int]:
    """Import ``src`` (format ``fmt``) as version ``step`` under ``out``; returns (version URL, tensors).

    ``force``: replace a version ``step`` already under ``out`` (it stays until the new one commits)."""
    fn = {"safetensors": from_safetensors, "torch": from_torch, "torch-dcp": from_dcp}.get(fmt)
    if fn is None:
        raise ConvertError(f"unknown import format {fmt!r}; use safetensors, torch or torch-dcp")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        # version_dir(-1) is "step--00000000001", which no reader lists: the import would vanish
        raise ConvertError(f"--step must be a non-negative integer (got {step!r})")
    local = src.removeprefix("file://")
    if not os.path.exists(local):
        from resilient_tools.errors import BadUrl
        raise BadUrl(f"{src}: no such file or folder to import (import reads local files)")
    if fmt == "torch-dcp" and not os.path.isdir(local):
        raise ConvertError(f"{src}: is a file; --from torch-dcp reads a DCP folder (use --from torch or safetensors "
                           "for a file)")
    if fmt != "torch-dcp" and os.path.isdir(local):
        raise ConvertError(f"{src}: is a folder; --from {fmt} reads one file (use --from torch-dcp for a DCP folder)")
    w = VersionWriter(out, step, layout={"world": 1, "imported_from": fmt}, compress=compress, force=force,
                      extra={"imported_from": os.path.abspath(local), "format": fmt})
    try:
        n = fn(src, w, block_bytes, progress)
        url = w.commit()
    except BaseException:
        w.abort()
        raise
    return url, n
