"""``ckpt import --from torch-dcp`` reads DCP's pickled ``.metadata``: a crafted one never runs code.

Every crafted pickle here would, if any global outside the allow-list were
resolved, create a sentinel file (through os.system, eval, exec, subprocess,
open, torch.save, a module whose import has a side effect, or a dotted name
walked from an allowed module to ``os.system``). Each must be refused with
:class:`UnsafeCheckpoint`, leave no sentinel, and import no module.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from resilient.errors import ResilientError
from resilient_tools.cli import main
from resilient_tools.errors import UnsafeCheckpoint
from resilient_tools.importer import _dcp_allowed, read_dcp_metadata

SENTINEL = "{sentinel}"  # replaced by the example's own path
_PY_TOUCH = f"open({SENTINEL!r}, 'w').close()"
_SH_TOUCH = f"touch {SENTINEL}"

# (module, name, args): each one creates SENTINEL when called with args.
GADGETS = [
    ("os", "system", (_SH_TOUCH,)),
    ("posix", "system", (_SH_TOUCH,)),
    ("builtins", "eval", (_PY_TOUCH,)),
    ("builtins", "exec", (_PY_TOUCH,)),
    ("__builtin__", "eval", (_PY_TOUCH,)),  # the protocol-2 spelling, which the default unpickler maps
    ("subprocess", "getoutput", (_SH_TOUCH,)),
    ("subprocess", "getstatusoutput", (_SH_TOUCH,)),
    ("io", "open", (SENTINEL, "w")),
    ("builtins", "open", (SENTINEL, "w")),
    ("posix", "mkdir", (SENTINEL,)),
    # allowed modules, names that are not on the list
    ("torch", "save", ("x", SENTINEL)),
    ("pathlib", "os.system", (_SH_TOUCH,)),
    # dotted names walked from allowed modules (protocol >= 4 resolves them attribute by attribute)
    ("torch.distributed.checkpoint.filesystem", "os.system", (_SH_TOUCH,)),
    ("torch.distributed.checkpoint.metadata", "torch.serialization.os.system", (_SH_TOUCH,)),
    ("torch.serialization", "os.system", (_SH_TOUCH,)),
    ("torch", "os.system", (_SH_TOUCH,)),
    ("collections", "_sys.modules.__getitem__", ("os",)),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__", ()),
    ("torch", "Size.__class__.__subclasses__", ()),
]
PROBE_MODULE = "resilient_probe_import_side_effect"  # its import creates SENTINEL (written per example)


def _s(text: str) -> bytes:
    """A protocol-0 unicode string opcode (valid under every protocol)."""
    return b"V" + text.encode("raw-unicode-escape") + b"\n"


def _global(form: str, module: str, name: str) -> bytes:
    if form == "stack_global":
        return _s(module) + _s(name) + b"\x93"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def crafted(protocol: int, form: str, module: str, name: str, args: tuple[str, ...]) -> bytes:
    """A hand-assembled pickle that calls ``module.name(*args)`` by one of pickle's calling opcodes."""
    head = b"\x80" + bytes([protocol]) if protocol >= 2 else b""
    strs = b"".join(_s(a) for a in args)
    body = {
        "reduce": _global("global", module, name) + b"(" + strs + b"tR",
        "stack_reduce": _global("stack_global", module, name) + b"(" + strs + b"tR",
        "inst": b"(" + strs + b"i" + module.encode() + b"\n" + name.encode() + b"\n",
        "obj": b"(" + _global("global", module, name) + strs + b"o",
        "newobj": _global("stack_global", module, name) + b"(" + strs + b"t\x81",
    }[form]
    return head + body + b"."


class Gadget:
    """A real object whose pickle calls ``fn(*args)`` on load: what an attacker writes with pickle.dumps."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _real_metadata(folder: Path):
    import torch.distributed.checkpoint as dcp
    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
                       "i": torch.arange(3), "cl": torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last),
                       "f8": torch.zeros(2, dtype=torch.float8_e4m3fn), "c": torch.zeros(2, dtype=torch.complex64)},
             "optim": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return state


def test_real_dcp_metadata_reads_and_every_global_is_on_the_list(tmp_path):
    """The allow-list is what torch's own dcp.save writes: every global it names is on the list."""
    _real_metadata(tmp_path)
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # trusted here: the file is the test's own
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    raw = (tmp_path / ".metadata").read_bytes()
    want = Recording(io.BytesIO(raw)).load()
    got = read_dcp_metadata(str(tmp_path))
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data
    assert got.storage_meta.checkpoint_id == want.storage_meta.checkpoint_id  # a PurePosixPath now
    assert seen <= set(_dcp_allowed()), seen - set(_dcp_allowed())
    assert ("torch.distributed.checkpoint.metadata", "TensorProperties") in seen


def _check_refused(folder: Path, data: bytes, sentinel: Path) -> None:
    (folder / ".metadata").write_bytes(data)
    _dcp_allowed()  # the table loads its own (fixed) modules once; the pickle may load none
    modules_before = set(sys.modules)
    with pytest.raises(UnsafeCheckpoint) as info:
        read_dcp_metadata(str(folder))
    assert isinstance(info.value, ResilientError)
    assert "refusing" in str(info.value)
    assert not os.path.exists(sentinel), "a gadget ran"
    assert set(sys.modules) - modules_before == set(), "the unpickler imported a module"


def _fill(args: tuple[str, ...], sentinel: Path) -> tuple[str, ...]:
    return tuple(a.replace(SENTINEL, str(sentinel)) for a in args)


@settings(max_examples=250, deadline=None)
@given(protocol=st.integers(0, 5), form=st.sampled_from(["reduce", "stack_reduce", "inst", "obj", "newobj"]),
       gadget=st.sampled_from(GADGETS + [(PROBE_MODULE, "anything", ())]))
def test_crafted_globals_are_refused_and_never_run(protocol, form, gadget):
    module, name, args = gadget
    with tempfile.TemporaryDirectory() as d:
        folder, sentinel = Path(d), Path(d) / "pwned"
        probe_dir = Path(d) / "path"
        probe_dir.mkdir()
        (probe_dir / f"{PROBE_MODULE}.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
        sys.path.insert(0, str(probe_dir))
        try:
            _check_refused(folder, crafted(protocol, form, module, name, _fill(args, sentinel)), sentinel)
        finally:
            sys.path.remove(str(probe_dir))
            sys.modules.pop(PROBE_MODULE, None)


@settings(max_examples=60, deadline=None)
@given(protocol=st.integers(0, 5), gadget=st.sampled_from([g for g in GADGETS if "." not in g[1]]),
       embedded=st.booleans())
def test_pickled_reduce_gadgets_are_refused(protocol, gadget, embedded):
    """What pickle.dumps writes for a ``__reduce__`` gadget, alone or hidden in a real Metadata's planner_data."""
    from torch.distributed.checkpoint.metadata import Metadata
    module, name, args = gadget
    fn = getattr(__import__(module.replace("__builtin__", "builtins")), name)
    with tempfile.TemporaryDirectory() as d:
        folder, sentinel = Path(d), Path(d) / "pwned"
        obj = Gadget(fn, _fill(args, sentinel))
        if embedded:
            obj = Metadata(state_dict_metadata={}, planner_data={"x": obj})
        _check_refused(folder, pickle.dumps(obj, protocol=protocol), sentinel)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_extension_codes_go_through_the_allow_list(tmp_path, protocol):
    """EXT1/2/4 name a global through copyreg's registry: the same refusal applies."""
    sentinel = tmp_path / "pwned"
    copyreg.add_extension("posix", "system", 0x7A)
    try:
        data = b"\x80" + bytes([protocol]) + b"\x82\x7a(" + _s(f"touch {sentinel}") + b"tR."
        _check_refused(tmp_path, data, sentinel)
    finally:
        copyreg.remove_extension("posix", "system", 0x7A)


def test_persistent_ids_are_refused(tmp_path):
    _check_refused(tmp_path, b"\x80\x04" + _s("x") + b"Q.", tmp_path / "none")


def test_metadata_with_a_foreign_object_in_a_field_is_refused(tmp_path):
    """A real Metadata whose storage_data holds a harmless class that is simply not DCP's (datetime)."""
    import datetime

    from torch.distributed.checkpoint.metadata import Metadata
    data = pickle.dumps(Metadata(state_dict_metadata={}, storage_data={"k": datetime.datetime.now()}), protocol=4)
    _check_refused(tmp_path, data, tmp_path / "none")


def test_import_cli_refuses_a_crafted_folder_with_exit_2(tmp_path, capsys):
    sentinel = tmp_path / "pwned"
    folder = tmp_path / "dcp"
    folder.mkdir()
    data = crafted(4, "stack_reduce", "torch.distributed.checkpoint.filesystem", "os.system", (f"touch {sentinel}",))
    (folder / ".metadata").write_bytes(data)
    rc = main(["-q", "import", str(folder), str(tmp_path / "out"), "--from", "torch-dcp"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "os.system" in err and "refusing" in err
    assert not sentinel.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("manifest*"))
