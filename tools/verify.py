"""``ckpt verify``: is a version sound? Every checksum, every object, full coverage.

Unlike restore, which stops at the first bad chunk and falls back, verify
keeps going and names every bad or missing object, so an operator knows what
was lost. ``fast`` checks structure only (manifest sanity, chunks tile each
tensor, every object exists and is long enough) without reading payloads.
Memory: at most 32 MiB of chunks (``--inflight-mb``; at least one chunk) in flight.
"""

from __future__ import annotations

from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from resilient.snapshot.api import FormatVersionError, Manifest, NoSnapshotFound, SnapshotError
from resilient.snapshot.boxes import Box
from resilient.snapshot.reader import SnapshotReader

from resilient_tools.progress import Progress
from resilient_tools import fetch
from resilient_tools.source import open_source, split_version

@dataclass
class Problem:
    object: str
    tensor: str | None
    problem: str

    def to_json(self) -> dict:
        return {"object": self.object, "tensor": self.tensor, "problem": self.problem}


@dataclass
class VerifyReport:
    url: str
    step: int | None
    fast: bool
    chunks: int = 0
    bytes_checked: int = 0
    checked: str = "integrity"   # "integrity" (CRCs only, no secret) or "authenticity" (CRCs and MACs)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_objects(self) -> list[str]:
        return sorted({p.object for p in self.problems})


def check_structure(reader: SnapshotReader, m: Manifest) -> list[Problem]:
    """Manifest sanity and object presence, without reading payloads."""
    problems: list[Problem] = []
    vdir = reader.manifest_path(m.step).rsplit("/", 1)[0]
    ends: dict[str, tuple[int, str]] = {}
    for name, t in m.tensors.items():
        # byte counts against the box and overlaps are refused when the manifest is parsed
        # (format.manifest_from_json): what is left to see here is a gap
        vol = 0
        for c in t.chunks:
            vol += Box(c.offsets, c.sizes).numel
            end = c.offset + c.length
            if end > ends.get(c.object, (-1, ""))[0]:
                ends[c.object] = (end, name)
        if vol != t.numel:
            problems.append(Problem(f"{vdir}/manifest.json", name, f"chunks hold {vol} elements, the tensor "
                                    f"{list(t.shape)} has {t.numel}: gaps or overlaps"))
    for obj, (end, name) in sorted(ends.items()):
        path = f"{vdir}/{obj}"
        try:
            size = reader.fs.size(path)
        except FileNotFoundError:
            problems.append(Problem(path, name, "object is missing"))
            continue
        if size < end:
            problems.append(Problem(path, name, f"object is truncated: {size} bytes, chunks need {end}"))
    return problems


def check_payloads(reader: SnapshotReader, m: Manifest, skip: set[str], progress: bool) -> tuple[list[Problem], int, int]:
    """Read every chunk (except in objects already known bad) and check its checksum and length."""
    work = [(t, c) for t in m.tensors.values() for c in t.chunks
            if reader.object_path(m, c) not in skip]
    bar = Progress(f"verify step {m.step}", sum(c.length for _, c in work), progress)
    problems: list[Problem] = []
    budget = fetch.DEFAULT_INFLIGHT  # bytes of chunks in flight (at least one chunk)

    def check(t, c) -> Problem | None:
        try:
            reader.check_chunk(m, t, c)
        except SnapshotError as e:
            return Problem(reader.object_path(m, c), t.name, str(e))
        return None

    with ThreadPoolExecutor(max(1, reader.threads)) as pool:
        inflight: deque = deque()
        held = 0
        for t, c in work:
            while inflight and held + c.length > budget:
                c0, f0 = inflight.popleft()
                p = f0.result()
                problems += [p] if p else []
                held -= c0.length
                bar.advance(c0.length)
            inflight.append((c, pool.submit(check, t, c)))
            held += c.length
        while inflight:
            c0, f0 = inflight.popleft()
            p = f0.result()
            problems += [p] if p else []
            bar.advance(c0.length)
    bar.close()
    return problems, len(work), bar.done


def _checked() -> str:
    from resilient_tools import source
    if source.SECRET is None:
        return "integrity"
    return f"authenticity (MACs under secret {source.SECRET.fingerprint})"


def verify(spec: str, fast: bool = False, threads: int = 4, progress: bool = True) -> VerifyReport:
    """Verify ``URL[@STEP]``. A manifest that cannot be read is itself a problem (naming it), not a crash."""
    url, step = split_version(spec)
    try:
        src = open_source(spec, threads)
    except (FormatVersionError, NoSnapshotFound):
        # not damage: this resilient is too old to judge it (exit 2, "upgrade"), or there is nothing
        # to judge (an empty folder, a step that is not there): a usage error, not a verdict
        raise
    except SnapshotError as e:
        report = VerifyReport(url, step, fast, checked=_checked())
        report.problems.append(Problem(e.obj or url, None, str(e)))
        return report
    m = src.manifest
    report = VerifyReport(src.url, m.step, fast, checked=_checked())
    report.problems = check_structure(src.reader, m)
    report.chunks = sum(len(t.chunks) for t in m.tensors.values())
    if not fast:
        missing = {p.object for p in report.problems if p.problem == "object is missing"}
        short = {p.object for p in report.problems if p.problem.startswith("object is truncated")}
        more, report.chunks, report.bytes_checked = check_payloads(src.reader, m, missing, progress)
        # a chunk past the end of an object already reported truncated says nothing new
        report.problems += [p for p in more if not (p.object in short and "object is truncated" in p.problem)]
    return report


def format_report(r: VerifyReport) -> str:
    what = "structure" if r.fast else f"{r.chunks} chunks, {r.bytes_checked / 1e6:,.1f} MB"
    how = ("integrity only (CRC-32C): authenticity NOT checked; give --secret-file to check the MACs"
           if r.checked == "integrity" else r.checked)
    if r.ok:
        return f"OK  {r.url} step {r.step}: {what} verified; {how}"
    by_obj: dict[str, list[Problem]] = defaultdict(list)
    for p in r.problems:
        by_obj[p.object].append(p)
    lines = [f"BAD {r.url} step {r.step}: {len(r.problems)} problem(s) in {len(by_obj)} object(s); checked {how}"]
    for obj, ps in sorted(by_obj.items()):
        lines.append(f"  {obj}")
        for p in ps[:5]:
            lines.append(f"    {p.tensor or '-'}: {p.problem}")
        if len(ps) > 5:
            lines.append(f"    ... and {len(ps) - 5} more")
    return "\n".join(lines)
