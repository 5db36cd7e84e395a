"""``ckpt diff``: compare two versions tensor by tensor, bitwise or within a tolerance.

Why: a resharded or converted checkpoint must hold the same numbers, and two
runs that should be deterministic must end equal. Both sides are read in the
same row blocks (two reused buffers), so memory stays a few blocks whatever
the model's size. Differences use ``torch.allclose``'s rule:
``|a - b| <= atol + rtol * |b|``; equal values (also infinities of the same
sign) and NaNs in the same place count as equal, an infinite difference never
as close.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.snapshot.format import dtype_from_name

from resilient_tools.blocks import BlockBuffer, itemsize, row_blocks
from resilient_tools.fetch import fill
from resilient_tools.progress import Progress
from resilient_tools.source import Source


@dataclass
class TensorDiff:
    name: str
    status: str            # equal | close | differ | only-a | only-b | shape | dtype
    max_abs: float = 0.0
    max_rel: float = 0.0
    mismatched: int = 0    # elements not bitwise equal
    detail: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "mismatched": self.mismatched, "detail": self.detail}


@dataclass
class DiffReport:
    a: str
    b: str
    tolerance: bool
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[str] = field(default_factory=list)

    @property
    def match(self) -> bool:
        ok = ("equal", "close") if self.tolerance else ("equal",)
        return all(t.status in ok for t in self.tensors)


def _compare_block(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[int, float, float, bool]:
    """(elements not bitwise equal, max abs diff, max rel diff, all close) of one block."""
    ab, bb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if torch.equal(ab, bb):  # the common case, without temporaries
        return 0, 0.0, 0.0, True
    bad = int((~(ab.view(-1, a.element_size()) == bb.view(-1, b.element_size())).all(dim=1)).sum())
    if a.dtype == torch.bool:
        return bad, 1.0, 1.0, False
    wide = torch.float64 if a.dtype in (torch.float64, torch.int64, torch.uint64, torch.uint32) else torch.float32
    if a.is_complex():
        x, y = a.to(torch.complex128), b.to(torch.complex128)
    else:
        x, y = a.to(wide), b.to(wide)
    # Equal values (inf == inf, 0.0 == -0.0) and NaNs in the same place are close at any tolerance:
    # inf - inf is NaN and atol + rtol * |NaN| is NaN, so the plain rule called them different.
    same = x == y
    if x.is_floating_point() or x.is_complex():
        same |= torch.isnan(x) & torch.isnan(y)
    d = (x - y).abs().masked_fill(same, 0)
    ref = y.abs().masked_fill(same, 0)
    # where they differ, an infinite or NaN difference is never within tolerance (rtol * inf would say it is)
    close = bool((same | (torch.isfinite(d) & (d <= atol + rtol * ref))).all())
    rel = d / ref.clamp_min(torch.finfo(d.dtype).tiny)
    max_abs = float(torch.nan_to_num(d, nan=float("inf"), posinf=float("inf")).max())
    max_rel = float(torch.nan_to_num(rel.masked_fill(d == 0, 0), nan=float("inf"), posinf=float("inf")).max())
    return bad, max_abs, max_rel, close


def diff(a: Source, b: Source, *, atol: float | None = None, rtol: float | None = None,
         block_bytes: int = 16 << 20, progress: bool = True) -> DiffReport:
    """Compare every tensor of ``a`` with the same-named tensor of ``b``."""
    tol = atol is not None or rtol is not None
    atol, rtol = atol or 0.0, rtol or 0.0
    ma, mb = a.manifest, b.manifest
    report = DiffReport(f"{a.url}@{ma.step}", f"{b.url}@{mb.step}", tol)
    common = [n for n in ma.tensors if n in mb.tensors]
    total = sum(ma.tensors[n].numel * itemsize(dtype_from_name(ma.tensors[n].dtype, n)) for n in common)
    bar = Progress("diff", total, progress)
    bufa, bufb = BlockBuffer(block_bytes), BlockBuffer(block_bytes)
    for name in sorted(set(ma.tensors) | set(mb.tensors)):
        ta, tb = ma.tensors.get(name), mb.tensors.get(name)
        if ta is None or tb is None:
            report.tensors.append(TensorDiff(name, "only-b" if ta is None else "only-a"))
            continue
        if ta.shape != tb.shape:
            report.tensors.append(TensorDiff(name, "shape", detail=f"{list(ta.shape)} vs {list(tb.shape)}"))
            continue
        if ta.dtype != tb.dtype:
            report.tensors.append(TensorDiff(name, "dtype", detail=f"{ta.dtype} vs {tb.dtype}"))
            continue
        dtype = dtype_from_name(ta.dtype, name)
        td, close = TensorDiff(name, "equal"), True
        for box in row_blocks(ta.shape, itemsize(dtype), block_bytes):
            va, vb = bufa.view(box, dtype), bufb.view(box, dtype)
            fill(a.reader, ma, ta, [(box, va)])
            fill(b.reader, mb, tb, [(box, vb)])
            bad, mabs, mrel, ok = _compare_block(va, vb, atol, rtol)
            td.mismatched += bad
            td.max_abs, td.max_rel = max(td.max_abs, mabs), max(td.max_rel, mrel)
            close = close and ok
            bar.advance(box.numel * itemsize(dtype))
        if td.mismatched:
            td.status = "close" if close and tol else "differ"
        report.tensors.append(td)
    bar.close()
    report.values = sorted(k for k in set(ma.values) | set(mb.values) if ma.values.get(k) != mb.values.get(k))
    return report


def format_diff(r: DiffReport, show_equal: bool = False) -> str:
    lines = []
    for t in r.tensors:
        if t.status == "equal" and not show_equal:
            continue
        if t.status in ("equal", "close", "differ"):
            lines.append(f"{t.status:7} {t.name}  mismatched={t.mismatched} max_abs={t.max_abs:.3g} "
                         f"max_rel={t.max_rel:.3g}")
        else:
            lines.append(f"{t.status:7} {t.name}  {t.detail}")
    for v in r.values:
        lines.append(f"value   {v} differs (JSON value; not part of the verdict)")
    n_eq = sum(t.status == "equal" for t in r.tensors)
    verdict = "MATCH" if r.match else "DIFFER"
    how = "within tolerance" if r.tolerance else "bitwise"
    lines.append(f"{verdict} ({how}): {n_eq}/{len(r.tensors)} tensors bitwise equal  [{r.a} vs {r.b}]")
    return "\n".join(lines)


def to_json(r: DiffReport) -> dict[str, Any]:
    return {"a": r.a, "b": r.b, "match": r.match, "tolerance": r.tolerance,
            "tensors": [t.to_json() for t in r.tensors], "values_differ": r.values}
