"""``ckpt gc``: apply retention by hand, with the runtime's own rules.

Uses :mod:`resilient.snapshot.retention` (the same plan the committer runs
after each commit): keep the newest K complete versions and every M-th, never
the newest complete one; remove incomplete versions older than it (debris of
cut-short uploads). Incomplete versions newer than it may still be arriving
and are kept. ``dry_run`` only says what would go.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilient.snapshot.retention import collect_garbage, list_versions, plan_retention
from resilient.snapshot.storage import RetryPolicy, with_retry

from resilient_tools.errors import CkptToolError
from resilient_tools.source import open_reader


@dataclass
class GcResult:
    removed: list[int]
    kept: list[int]
    incomplete_kept: list[int]
    dry_run: bool


def gc(url: str, keep_last: int, keep_every: int = 0, dry_run: bool = False) -> GcResult:
    if keep_last < 1:
        raise CkptToolError(f"--keep-last must be >= 1 (got {keep_last}); the newest complete version is always kept")
    reader = open_reader(url)
    fs, root = reader.fs, reader.root
    versions = list_versions(fs, root)
    doomed = plan_retention({s: ok for s, (_, ok) in versions.items()}, keep_last, keep_every)
    if not dry_run:
        doomed, _ = with_retry(lambda: collect_garbage(fs, root, keep_last, keep_every), url, RetryPolicy())
    kept = sorted(s for s, (_, ok) in versions.items() if ok and s not in doomed)
    pending = sorted(s for s, (_, ok) in versions.items() if not ok and s not in doomed)
    return GcResult(doomed, kept, pending, dry_run)


def format_gc(r: GcResult) -> str:
    verb = "would remove" if r.dry_run else "removed"
    return (f"{verb}: {r.removed or 'nothing'}\nkept complete: {r.kept or 'none'}"
            + (f"\nkept incomplete (newer than the newest complete; may still be uploading): {r.incomplete_kept}"
               if r.incomplete_kept else ""))
