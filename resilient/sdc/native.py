"""Fused one-pass checksum kernels for CPU tensors (``native.c``), with a torch fallback.

Why C: on CPU the checks' cost is passes over memory and per-tensor dispatch,
not arithmetic. torch's ``sum(dtype=float64)`` of float32 runs well below
memory speed, and an L1, a float64 sum and a bit-sum of the same gradient are
three kernels and three passes. ``native.c`` computes them in one pass per
tensor, and a list of tensors per call. Measured in the demo's training step
(``bench/sdc_cost.py``, runs alternating with ``RESILIENT_NATIVE=0``, rank 0,
process CPU per step): the reduce-scatter wrapper 4.4-4.8 → 1.7-1.9 ms, the
at-rest records and checks 4.0-4.4 → 2.5-2.7 ms, all checks 11.4-12.2 →
7.1-7.7 ms. What is left is mostly memory: the data these passes read has
just been pushed out of the caches by forward and backward.

Why not inductor: ``torch.compile`` fuses the same passes but compiles for
4-24 s in every new worker, i.e. in every recovery. This compiles once per
machine (~0.3 s with the system C compiler) into a cache keyed by the source,
the compiler and the CPU, and a worker then loads it in a millisecond.

Results are those of the torch code they replace: bit-sums are the same
integers (sums modulo 2**32 do not depend on order), float64 sums may differ
in the last bits (every bound charges float64 rounding for any order).

Without a C compiler, or with ``RESILIENT_NATIVE=0``, every function here
returns ``None`` and callers use torch: slower, the same answers. Only CPU
tensors that are contiguous float32 (bit-sums: any 4-byte dtype) qualify.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from resilient.contract import NATIVE_ENV
from resilient.sdc import native_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"rs_rows_sum_l1": [_P, _I64, _I64, _P, _P], "rs_sum_bits": [_P, _I64, _P, _P],
               "rs_stats": [_I64, _P, _P, _P], "rs_bitsums": [_I64, _P, _P, _P],
               "rs_gemm_weight": [_P, _I64, _I64, _P, _P, _P, _P],
               "rs_gemm_rows": [_P, _I64, _I64, _P, _P, _P, _P, _P, _P],
               "rs_gemm_dy": [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P],
               "rs_gemm_record": [_P, _I64, _I64, _P, _P, ctypes.c_double, ctypes.c_double, ctypes.c_double, _P]}


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, :mod:`.native_build`), or None
    where that is impossible or switched off (``RESILIENT_NATIVE=0``)."""
    if os.environ.get(NATIVE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    lib = native_build.load(SOURCE)
    if lib is None:
        return None
    try:
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, args
    except AttributeError as e:   # e.g. built by a C++ compiler despite -x c: mangled names
        log.warning("resilient.sdc: %s lacks a kernel (%s); SDC checks use torch kernels", SOURCE.name, e)
        return None
    return lib


def _f32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel() > 0


def _words(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.element_size() == 4 and x.is_contiguous()


def rows_sum_l1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of a 2-d float32 ``x``: (float64 sums ``[rows]``, float64 L1s ``[rows]``)."""
    if x.dim() != 2 or not _f32(x) or (lib := library()) is None:
        return None
    s = torch.empty(x.shape[0], dtype=torch.float64)
    a = torch.empty(x.shape[0], dtype=torch.float64)
    lib.rs_rows_sum_l1(x.data_ptr(), x.shape[0], x.shape[1], s.data_ptr(), a.data_ptr())
    return s, a


def sum_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(0-dim float64 sum, 0-dim int32 bit-sum) of a float32 ``x``."""
    if not _f32(x) or (lib := library()) is None:
        return None
    s = torch.empty((), dtype=torch.float64)
    b = torch.empty((), dtype=torch.int64)
    lib.rs_sum_bits(x.data_ptr(), x.numel(), s.data_ptr(), b.data_ptr())
    return s, b.to(torch.int32)


def bitsum(x: torch.Tensor) -> torch.Tensor | None:
    """0-dim int32 bit-sum of a tensor of 4-byte elements."""
    if not _words(x) or (lib := library()) is None:
        return None
    ptr, n, out = ctypes.c_uint64(x.data_ptr()), ctypes.c_int64(x.numel()), ctypes.c_int64()
    lib.rs_bitsums(1, ctypes.addressof(ptr), ctypes.addressof(n), ctypes.addressof(out))
    return torch.tensor(out.value, dtype=torch.int32)


def stats_rows(xs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[len(xs), 4]`` float64 rows (sum, L1, amax, bit-sum as int64 bytes) of
    float32 tensors, in one call; the layout of :func:`~.checksums.stats`."""
    if not xs or not all(_f32(x) for x in xs) or (lib := library()) is None:
        return None
    ptrs, lens = _table(xs)
    out = torch.empty(len(xs), 4, dtype=torch.float64)
    lib.rs_stats(len(xs), ptrs.data_ptr(), lens.data_ptr(), out.data_ptr())
    return out


def _table(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pointers and lengths (in elements) for a kernel that walks a list."""
    return (torch.tensor([x.data_ptr() for x in xs], dtype=torch.int64),
            torch.tensor([x.numel() for x in xs], dtype=torch.int64))


class Segments:
    """A fixed list of 4-byte-element CPU segments whose bit-sums are taken
    again and again: pointer and length tables built once (valid while the
    tensors stay where they are; :class:`~.atrest.BitSums` checks that)."""

    def __init__(self, segs: Sequence[torch.Tensor]):
        self.n = len(segs)
        self.ok = all(_words(s) for s in segs) and (lib := library()) is not None
        self.lib = lib if self.ok else None
        if self.ok:
            self.keep = list(segs)            # the tables hold raw pointers: keep the storage alive
            self.ptrs, self.lens = _table(segs)

    def __call__(self) -> torch.Tensor:
        out = torch.empty(self.n, dtype=torch.int64)
        if self.n:
            self.lib.rs_bitsums(self.n, self.ptrs.data_ptr(), self.lens.data_ptr(), out.data_ptr())
        return out


# ---- the checksummed GEMMs (abft.py): float32 operands and sides ---------------------------

def gemm_ready(*mats: torch.Tensor, vecs: Sequence[torch.Tensor] = ()) -> ctypes.CDLL | None:
    """The kernels, when every operand is a contiguous float32 CPU tensor, ``mats`` 2-d and
    not empty; else None."""
    for x in mats:
        if x.dim() != 2 or not x.numel():
            return None
    for x in (*mats, *vecs):
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
            return None
    return library()


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def gemm_weight(lib: ctypes.CDLL, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(row sums, |.| row sums [N], column sums, |.| column sums [K]) of ``w`` [N, K]."""
    n, k = w.shape
    rows, cols = torch.empty(2, n, dtype=torch.float32), torch.empty(2, k, dtype=torch.float32)
    lib.rs_gemm_weight(w.data_ptr(), n, k, rows.data_ptr(), rows.data_ptr() + 4 * n, cols.data_ptr(),
                       cols.data_ptr() + 4 * k)
    return (*rows.unbind(), *cols.unbind())   # (views: unbind is one call, split several)


def gemm_rows(lib: ctypes.CDLL, x: torch.Tensor, v: torch.Tensor, va: torch.Tensor,
              with_rows: bool) -> tuple[torch.Tensor, ...]:
    """(x·v, |x|·va [M]) of ``x`` [M, K], and with ``with_rows`` its (row sums, |.| row sums)."""
    m, k = x.shape
    out = torch.empty(4 if with_rows else 2, m, dtype=torch.float32)
    p = out.data_ptr()
    lib.rs_gemm_rows(x.data_ptr(), m, k, v.data_ptr(), va.data_ptr(), p, p + 4 * m,
                     p + 8 * m if with_rows else None, p + 12 * m if with_rows else None)
    parts = out.unbind()
    return parts if with_rows else (*parts, None, None)


def gemm_dy(lib: ctypes.CDLL, dy: torch.Tensor, wr: torch.Tensor, war: torch.Tensor,
            xr: torch.Tensor | None = None, xar: torch.Tensor | None = None,
            cols: torch.Tensor | None = None, abs_cols: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy·wr, |dy|·war [M]) of ``dy`` [M, N]; with ``xr``, also dyᵀ·xr and |dy|ᵀ·xar added
    into ``cols`` and ``abs_cols`` [N] (float32, contiguous)."""
    m, n = dy.shape
    out = torch.empty(2, m, dtype=torch.float32)
    lib.rs_gemm_dy(dy.data_ptr(), m, n, wr.data_ptr(), war.data_ptr(), _ptr(xr), _ptr(xar), out.data_ptr(),
                   out.data_ptr() + 4 * m, _ptr(cols), _ptr(abs_cols))
    return out.unbind()


def gemm_record(lib: ctypes.CDLL, y: torch.Tensor, expect: torch.Tensor, scale: torch.Tensor, rel: float,
                floor: float, harm: float) -> torch.Tensor:
    """float64 [5]: (worst |Δ|/bound, its |Δ|, its bound, its row, harm·max|y|) of ``y``
    [rows, width]'s row sums against ``expect`` within ``scale·rel + floor`` (native.c)."""
    out = torch.empty(5, dtype=torch.float64)
    lib.rs_gemm_record(y.data_ptr(), y.shape[0], y.shape[1], expect.data_ptr(), scale.data_ptr(), rel, floor,
                       harm, out.data_ptr())
    return out
