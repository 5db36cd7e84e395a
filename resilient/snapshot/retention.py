"""Retention of durable versions: keep the last K, every M-th, never the only one.

Deleting a version removes its manifest first, so a half-deleted version is
never visible as complete. Incomplete versions older than the newest complete
one are debris (an upload cut short, a version coalesced away on rank 0 but
uploaded by other ranks) and are removed; newer ones may still be arriving
and are left alone.
"""

from __future__ import annotations

import fsspec

from resilient.snapshot.format import MANIFEST_NAME, parse_version_dir


def list_versions(fs: fsspec.AbstractFileSystem, root: str) -> dict[int, tuple[str, bool]]:
    """``{step: (path, complete)}`` of the versions under ``root``."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    out: dict[int, tuple[str, bool]] = {}
    for path in entries:
        step = parse_version_dir(path)
        if step is None:
            continue
        out[step] = (path.rstrip("/"), False)
    for step, (path, _) in out.items():
        out[step] = (path, fs.exists(f"{path}/{MANIFEST_NAME}"))
    return out


def plan_retention(versions: dict[int, bool], keep_last: int, keep_every: int,
                   protect: set[int] = frozenset(), floor: int | None = None) -> list[int]:
    """Steps to delete, given ``{step: complete}``. Pure, so it is easy to test.

    ``floor``: also keep the newest complete version at or below it (the last one the
    SDC checks verified: a rollback goes back there, however many versions came since)."""
    complete = sorted(s for s, ok in versions.items() if ok)
    if not complete:
        return []
    newest = complete[-1]
    keep = set(complete[-max(keep_last, 1):]) | {newest} | set(protect)
    if floor is not None:
        keep |= set([s for s in complete if s <= floor][-1:])
    if keep_every > 0:
        keep |= {s for s in complete if s % keep_every == 0}
    return sorted(s for s, ok in versions.items()
                  if s not in keep and (ok or s < newest))


def collect_garbage(fs: fsspec.AbstractFileSystem, root: str, keep_last: int, keep_every: int,
                    protect: set[int] = frozenset(), floor: int | None = None) -> tuple[list[int], list[int]]:
    """Apply retention under ``root``; returns (removed steps, kept complete steps)."""
    versions = list_versions(fs, root)
    doomed = plan_retention({s: ok for s, (_, ok) in versions.items()}, keep_last, keep_every, protect, floor)
    remove_versions(fs, [versions[s] for s in doomed])
    kept = sorted(s for s, (_, ok) in versions.items() if ok and s not in doomed)
    fs.invalidate_cache(root)
    return doomed, kept


def drop_after(fs: fsspec.AbstractFileSystem, root: str, step: int) -> list[int]:
    """Delete every version newer than ``step`` (a rollback abandons them: they may hold
    the corruption it rolls back from); returns their steps."""
    versions = list_versions(fs, root)
    doomed = sorted(s for s in versions if s > step)
    remove_versions(fs, [versions[s] for s in doomed])
    fs.invalidate_cache(root)
    return doomed


def remove_versions(fs: fsspec.AbstractFileSystem, versions: list[tuple[str, bool]]) -> None:
    """Delete versions (path, complete?), each manifest first: a half-deleted version never
    looks complete. What is already gone (a retry after a partial first try) is skipped."""
    for path, complete in versions:
        try:
            if complete:
                fs.rm_file(f"{path}/{MANIFEST_NAME}")
        except FileNotFoundError:
            pass
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
