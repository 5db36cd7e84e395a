"""The native checksum kernels (resilient/sdc/native.c) give the torch code's
answers: bit-sums exactly, float64 sums within float64 rounding; where no C
compiler works the torch code runs instead."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
from datetime import timedelta

import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.sdc import native, native_build
from resilient.sdc.atrest import BitSums
from resilient.sdc.checksums import AMAX, BITS, L1, SUM, bits_view, gamma, stats

needs_native = pytest.mark.skipif(native.library() is None, reason="no working C compiler here")

f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _ref_bits(x: torch.Tensor) -> int:
    return int(bits_view(x.contiguous()).sum(dtype=torch.int32))


def _close(a: float, ref: float, l1: float, n: int) -> bool:
    """Two float64 sums of the same float32 values, in different orders."""
    if math.isnan(ref):
        return math.isnan(a)
    if math.isinf(ref):
        return a == ref
    return abs(a - ref) <= 2 * gamma(max(n, 1), 2.0 ** -53) * l1


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(f32, max_size=300))
def test_sum_and_bitsum_match_torch(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert int(native.bitsum(x)) == _ref_bits(x)
    if not values:
        assert native.sum_bits(x) is None        # nothing to sum: callers take the torch path
        return
    s, b = native.sum_bits(x)
    assert int(b) == _ref_bits(x) and b.dtype == torch.int32
    ref = x.double().sum().item()
    assert _close(s.item(), ref, x.double().abs().sum().item(), x.numel())


@needs_native
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5000), st.integers(0, 2 ** 31 - 1))
def test_rows_sum_l1_matches_float64(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(4 * torch.randn(rows, cols, generator=g))
    s, a = native.rows_sum_l1(x)
    ref_s, ref_a = x.double().sum(1), x.double().abs().sum(1)
    for r in range(rows):
        assert _close(s[r].item(), ref_s[r].item(), ref_a[r].item(), cols)
        assert _close(a[r].item(), ref_a[r].item(), ref_a[r].item(), cols)


@needs_native
def test_kernels_refuse_what_they_cannot_read():
    x = torch.randn(8, 6)
    assert native.rows_sum_l1(x.t()) is None                 # not contiguous
    assert native.rows_sum_l1(x.double()) is None            # not float32
    assert native.sum_bits(x.to(torch.bfloat16)) is None
    assert native.bitsum(x.to(torch.bfloat16)) is None      # 2-byte elements: torch's int16 path
    assert native.bitsum(x.view(torch.int32)) is not None    # any 4-byte element
    assert native.stats_rows([x, x.t()]) is None             # one unreadable tensor: the whole list falls back


@needs_native
def test_stats_rows_match_the_torch_path():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=g) for n in (1, 7, 1000, 70_001)]
    xs += [torch.tensor([1.0, float("nan"), -3.0]), torch.tensor([float("inf"), -2.0]),
           torch.tensor([float("inf"), float("-inf"), 1.0])]      # a NaN sum, but no NaN: amax is inf
    nat = stats(xs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "library", lambda: None)
        ref = stats(xs)                                      # the torch code
    assert nat.shape == ref.shape == (len(xs), 4)
    assert torch.equal(nat[:, BITS].contiguous().view(torch.int64), ref[:, BITS].contiguous().view(torch.int64))
    for i, x in enumerate(xs):
        l1 = x.double().abs().sum().item()
        assert _close(nat[i, SUM].item(), ref[i, SUM].item(), l1, x.numel())
        assert math.isclose(nat[i, L1].item(), ref[i, L1].item(), rel_tol=1e-5) or math.isnan(ref[i, L1])
        a, b = nat[i, AMAX].item(), ref[i, AMAX].item()
        assert a == b or (math.isnan(a) and math.isnan(b))


@needs_native
def test_at_rest_plan_matches_the_torch_path():
    """Lone tensors, a packed run of views into one storage (blocks), 0-dim step
    counters: the same entries and values, before and after a flip."""
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(200_000, generator=g)
    packed = [buf[:1000].view(10, 100), buf[1000:150_000], buf[150_000:]]
    tensors = [torch.randn(33, 7, generator=g), *packed, torch.tensor(3.0), torch.tensor(7.0)]
    nat = BitSums(tensors)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "library", lambda: None)
        ref = BitSums(tensors)
    assert nat.native.ok and not ref.native.ok
    assert nat.entries == ref.entries
    assert torch.equal(nat(), ref())
    before = nat()
    bits_view(buf)[140_000] ^= 1 << 30
    after_nat, after_ref = nat(), ref()
    assert torch.equal(after_nat, after_ref)
    moved = torch.nonzero(after_nat != before).flatten().tolist()
    assert len(moved) == 1 and 2 in nat.entries[moved[0]]    # the block that holds element 140000


def test_torch_fallback_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))                # no cc, gcc or clang either
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="resilient.sdc.native"):
            assert native.library() is None
        assert "no C compiler" in caplog.text
        x = torch.randn(100)
        assert native.sum_bits(x) is None and native.bitsum(x) is None
        s = stats([x])                                       # the torch path, same layout
        assert s.shape == (1, 4) and int(s[0, BITS:].view(torch.int64)) == _ref_bits(x)
    finally:
        native.library.cache_clear()


def test_a_compiler_that_fails_falls_back(tmp_path, monkeypatch, caplog):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(bad))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="resilient.sdc.native"):
            assert native.library() is None
        assert "internal error" in caplog.text
        assert not list((tmp_path / "cache").rglob("*.tmp"))   # no half-built library left behind
    finally:
        native.library.cache_clear()


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("RESILIENT_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
    finally:
        native.library.cache_clear()


@needs_native
def test_built_once_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        built = list((tmp_path / "resilient" / "native").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        stamp = built[0].stat().st_mtime_ns
        native.library.cache_clear()
        assert native.library() is not None                 # a new worker: loads, does not rebuild
        assert built[0].stat().st_mtime_ns == stamp
        assert list((tmp_path / "resilient" / "native").iterdir()) == built
    finally:
        native.library.cache_clear()


@needs_native
def test_a_damaged_build_is_rebuilt_not_loaded(tmp_path):
    """dlopen of a truncated library kills the process (SIGBUS) instead of raising:
    the cache must never hand one to ctypes. In a child process, so a regression
    cannot take the test run down with it."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    code = "from resilient.sdc import native; print(native.library() is not None)"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "True"
    (built,) = (tmp_path / "resilient" / "native").glob("*.so")
    with open(built, "r+b") as f:
        f.truncate(1000)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True" and "removing a damaged build" in r.stderr
    (again,) = (tmp_path / "resilient" / "native").glob("*.so")
    assert again.stat().st_size > 1000


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_a_cplusplus_driver_builds_c(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "g++")                           # would mangle the kernels' names as C++
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert native.bitsum(torch.ones(4)) is not None
    finally:
        native.library.cache_clear()


def test_a_hung_compiler_is_killed_and_not_waited_for_again(tmp_path, monkeypatch, caplog):
    runs = tmp_path / "runs"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho run >> {runs}\nsleep 6131 &\nexec sleep 6131\n")
    cc.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native_build, "COMPILE_TIMEOUT", timedelta(seconds=1))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="resilient.sdc.native"):
            assert native.library() is None
            assert "did not finish" in caplog.text
            native.library.cache_clear()                      # the next worker on this machine
            assert native.library() is None
            assert "failed recently" in caplog.text
        assert runs.read_text().count("run") == 1            # it did not try (and wait) again
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "6131"]]
        assert not left, f"compiler processes left behind: {left}"
    finally:
        native.library.cache_clear()


def _gemm_verdicts(native_on: bool, fault: str, seed: int, bias: bool) -> list[tuple[str, float]]:
    """(tensor, excess) of the GEMM suspicions of one step of two Linears, with ``fault``
    ('', 'forward', 'grad_input', 'grad_weight') struck in the second, native kernels on or off."""
    from resilient.sdc.api import SdcConfig
    from resilient.sdc.monitor import SdcMonitor

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 72, bias=bias), torch.nn.GELU(), torch.nn.Linear(72, 24, bias=bias))
    x = torch.randn(6, 11, 40, generator=torch.Generator().manual_seed(seed))

    def corrupt(t):
        t = t.clone()
        with torch.no_grad():
            t.view(-1)[7] *= 256
        return t

    hooks = {"forward": lambda: model[2].register_forward_hook(lambda m, a, out: corrupt(out), prepend=True),
             "grad_input": lambda: model[2].register_full_backward_hook(lambda m, gi, go: (corrupt(gi[0]),)),
             "grad_weight": lambda: model[2].weight.register_hook(corrupt)}
    if fault == "grad_weight":   # before the check's own hook on the weight
        hooks[fault]()
    with pytest.MonkeyPatch.context() as mp:
        if not native_on:
            mp.setattr(native, "library", lambda: None)
        mon = SdcMonitor(SdcConfig(abft_every=1, activation_every=0))
        mon.watch_compute(model)
        mon.note_restored(0, model)
        if fault in ("forward", "grad_input"):
            hooks[fault]()
        model(x).square().mean().backward()
        found = [(s.tensor, s.evidence["excess"]) for s in mon._compute_checks(1, judge=True)]
    assert 0 < mon.gemms.max_clean_ratio <= 1
    return found


@needs_native
@pytest.mark.parametrize("fault", ["", "forward", "grad_input", "grad_weight"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_native_gemm_checks_give_the_torch_paths_verdicts(fault, bias):
    """One pass per operand in C against the torch path (a kernel per quantity, |.|
    copies): the same GEMMs pass, the same one is named, by a like excess."""
    for seed in (0, 1):
        nat, ref = _gemm_verdicts(True, fault, seed, bias), _gemm_verdicts(False, fault, seed, bias)
        assert [t for t, _ in nat] == [t for t, _ in ref] == ([f"2:{fault}"] if fault else [])
        for (_, a), (_, b) in zip(nat, ref):
            assert math.isclose(a, b, rel_tol=0.05), (a, b)


@needs_native
def test_the_native_gemm_record_takes_the_first_worst_row_and_skips_nonfinite_rows():
    lib = native.library()
    y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [float("inf"), 0.0], [5.0, float("nan")], [1.0, 1.0]])
    expect = torch.tensor([3.0, 6.0, 1.0, 0.0, 1.0])   # rows 1 and 4 off by 1
    scale = torch.ones(5)
    ratio, diff, bound, row, harm = native.gemm_record(lib, y, expect, scale, 0.5, 0.5, 2.0).tolist()
    assert (ratio, diff, bound, row) == (1.0, 1.0, 1.0, 1.0)
    assert math.isnan(harm)   # a NaN in the output, as torch's aminmax says
    ratio, *_, harm = native.gemm_record(lib, y[:2].contiguous(), expect[:2].contiguous(), scale[:2].contiguous(),
                                         0.5, 0.5, 2.0).tolist()
    assert harm == 8.0
