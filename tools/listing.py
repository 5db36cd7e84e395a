"""``ckpt ls`` and ``ckpt inspect``: what versions exist and what one holds, from manifests only.

Neither reads a payload byte: ``ls`` opens each complete version's manifest
(JSON, small), ``inspect`` one. Sizes are stored bytes (after compression).
"""

from __future__ import annotations

import time
from typing import Any

from resilient.snapshot.api import SnapshotError
from resilient.snapshot.format import dtype_from_name

from resilient_tools.blocks import itemsize
from resilient_tools.source import Source, open_reader


def list_versions(url: str) -> list[dict[str, Any]]:
    """One row per version directory, oldest first: step, created, layout, world, bytes, complete, error."""
    reader = open_reader(url)
    rows = []
    for v in reader.versions():
        row: dict[str, Any] = {"step": v.step, "complete": v.complete, "created": None, "layout": None,
                               "world": None, "bytes": None, "tensors": None, "error": None}
        if v.complete:
            try:
                m = reader.manifest(v.step)
                row.update(created=m.created, layout=m.layout, world=m.world, bytes=m.nbytes, tensors=len(m.tensors))
            except SnapshotError as e:
                row["error"] = f"{type(e).__name__}: {e}"
        else:
            try:
                row["bytes"] = reader.fs.du(v.path)
            except OSError:
                pass
        rows.append(row)
    return rows


def format_ls(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'STEP':>12}  {'CREATED (UTC)':19}  {'STATE':10}  {'SIZE':>10}  {'TENSORS':>7}  LAYOUT"]
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created"])) if r["created"] else "-"
        state = "complete" if r["complete"] and not r["error"] else ("CORRUPT" if r["error"] else "incomplete")
        size = _size(r["bytes"]) if r["bytes"] is not None else "-"
        layout = ",".join(f"{k}={v}" for k, v in (r["layout"] or {}).items()) or "-"
        lines.append(f"{r['step']:>12}  {created:19}  {state:10}  {size:>10}  {r['tensors'] or '-':>7}  {layout}")
        if r["error"]:
            lines.append(f"{'':>12}  {r['error']}")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def describe(src: Source) -> dict[str, Any]:
    """The JSON ``inspect`` prints: version facts and one entry per tensor."""
    m = src.manifest
    tensors = {}
    for name, t in m.tensors.items():
        nbytes = t.numel * itemsize(dtype_from_name(t.dtype, name))
        tensors[name] = {"shape": list(t.shape), "dtype": t.dtype, "bytes": nbytes,
                         "stored_bytes": sum(c.length for c in t.chunks), "chunks": len(t.chunks)}
    return {"url": src.url, "step": m.step, "format_version": m.format_version, "created": m.created,
            "world": m.world, "layout": m.layout, "config_digest": m.config_digest, "attempt": m.attempt,
            "extra": m.extra, "values": m.values, "rank_extras": {str(k): v for k, v in m.rank_extras.items()},
            "bytes": sum(t["bytes"] for t in tensors.values()), "stored_bytes": m.nbytes,
            "objects": len(m.objects), "tensors": tensors}


def format_tree(d: dict[str, Any]) -> str:
    """Human view: header, then tensors grouped by their ``/``-separated name as a tree."""
    lines = [f"{d['url']} @ step {d['step']}  (format {d['format_version']}, "
             f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(d['created']))} UTC)",
             f"layout: {d['layout']}  world: {d['world']}",
             f"config digest: {d['config_digest'] or '(none)'}",
             f"extra: {_short(d['extra'])}",
             f"values: {', '.join(d['values']) or '(none)'}",
             f"{len(d['tensors'])} tensors, {_size(d['bytes'])} ({_size(d['stored_bytes'])} stored) "
             f"in {d['objects']} objects"]
    printed: list[str] = []
    for name, t in d["tensors"].items():
        parts = name.split("/")
        common = 0
        while common < min(len(parts) - 1, len(printed)) and printed[common] == parts[common]:
            common += 1
        for depth in range(common, len(parts) - 1):
            lines.append("  " * depth + parts[depth] + "/")
        printed = parts[:-1]
        lines.append(f"{'  ' * (len(parts) - 1)}{parts[-1]:<{max(1, 48 - 2 * (len(parts) - 1))}} "
                     f"{str(tuple(t['shape'])):>16} {t['dtype']:>9} {_size(t['bytes']):>9} "
                     f"{t['chunks']:>4} chunk{'s' if t['chunks'] != 1 else ''}")
    return "\n".join(lines)


def _short(value: Any, limit: int = 200) -> str:
    import json
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars; --json shows all)"
