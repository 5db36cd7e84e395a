"""``ckpt gc``: apply retention by hand, with the runtime's own rules, on versions that can be read.

The plan is :func:`resilient.snapshot.retention.plan_retention` (what the
committer runs after each commit): keep the newest K complete versions and
every M-th, never the newest complete one; remove incomplete versions older
than it (debris of cut-short uploads). Incomplete versions newer than it may
still be arriving and are kept. ``dry_run`` only says what would go.

What counts as complete differs from the runtime's listing on purpose: there
a version is complete when ``manifest.json`` *exists*, so a garbled newest
manifest was "the newest complete version" and retention deleted every
readable one. Here a version counts only if its manifest *parses*; one whose
manifest exists but does not parse (or is of a newer format) is neither
counted nor deleted: it may be repairable, and deleting data is not gc's call
to make on a guess. The newest readable version is therefore always kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resilient.snapshot.api import SnapshotError, StorageError
from resilient.snapshot.retention import list_versions, plan_retention, remove_versions
from resilient.snapshot.storage import RetryPolicy, with_retry

from resilient_tools.errors import CkptToolError
from resilient_tools.source import open_reader


@dataclass
class GcResult:
    removed: list[int]
    kept: list[int]
    incomplete_kept: list[int]
    dry_run: bool
    unreadable: dict[int, str] = field(default_factory=dict)  # step -> why its manifest cannot be read


def gc(url: str, keep_last: int, keep_every: int = 0, dry_run: bool = False) -> GcResult:
    if keep_last < 1:
        raise CkptToolError(f"--keep-last must be >= 1 (got {keep_last}); the newest complete version is always kept")
    if keep_every < 0:
        raise CkptToolError(f"--keep-every must be >= 0 (got {keep_every}); 0 keeps no extra versions")
    reader = open_reader(url)
    fs, root = reader.fs, reader.root
    policy = RetryPolicy()
    versions = with_retry(lambda: list_versions(fs, root), url, policy)
    readable: dict[int, bool] = {}
    unreadable: dict[int, str] = {}
    for step, (_, has_manifest) in versions.items():
        if not has_manifest:
            readable[step] = False
            continue
        try:
            reader.manifest(step)
            readable[step] = True
        except StorageError:
            raise  # storage kept failing: judging versions on a partial view could delete the wrong ones
        except SnapshotError as e:  # corrupt, or a newer format: not counted, not deleted
            unreadable[step] = f"{type(e).__name__}: {e}"
    doomed = plan_retention(readable, keep_last, keep_every)
    kept = sorted(s for s, ok in readable.items() if ok and s not in doomed)
    if any(readable.values()) and not kept:  # plan_retention guarantees it; deleting data must not rely on that
        raise AssertionError(f"retention plan would delete every readable version of {url}")
    if not dry_run:
        for step in doomed:
            path, _ = versions[step]
            with_retry(lambda: remove_versions(fs, [(path, readable[step])]), path, policy)
        fs.invalidate_cache(root)
    pending = sorted(s for s, ok in readable.items() if not ok and s not in doomed)
    return GcResult(doomed, kept, pending, dry_run, unreadable)


def format_gc(r: GcResult) -> str:
    verb = "would remove" if r.dry_run else "removed"
    lines = [f"{verb}: {r.removed or 'nothing'}", f"kept complete: {r.kept or 'none'}"]
    if r.incomplete_kept:
        lines.append(f"kept incomplete (newer than the newest complete; may still be uploading; if no writer is "
                     f"running, delete them by hand): {r.incomplete_kept}")
    for step, why in sorted(r.unreadable.items()):
        lines.append(f"kept unreadable step {step} (its manifest does not parse, so it is neither counted nor "
                     f"deleted; 'ckpt verify URL@{step}' says more, delete it by hand once judged): {why}")
    return "\n".join(lines)
