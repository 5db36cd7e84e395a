"""Open ``URL[@STEP]``: a reader on the URL and the manifest of the chosen version.

``@STEP`` is optional; without it the newest complete version is used. A URL
that does not exist, a step that is not there and a URL without any version
each get their own clear error, naming what *is* there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from resilient.snapshot.api import Manifest, NoSnapshotFound, SnapshotIncomplete
from resilient.snapshot.reader import SnapshotReader

from resilient_tools.errors import BadUrl

_STEP = re.compile(r"^(.*)@(\d+|latest)$")

# fsspec storage options for every URL the tools open (``--storage-options`` sets them), e.g.
# ``{"client_kwargs": {"endpoint_url": "http://minio:9000"}}`` for an S3-compatible store.
STORAGE_OPTIONS: dict = {}


def split_version(spec: str) -> tuple[str, int | None]:
    """``"s3://b/run@120"`` -> ``("s3://b/run", 120)``; no suffix (or ``@latest``) -> step None.

    Only a trailing ``@digits`` is a step, so ``s3://user@host/...`` style URLs survive."""
    m = _STEP.match(spec)
    if not m:
        return spec, None
    return m.group(1), (None if m.group(2) == "latest" else int(m.group(2)))


@dataclass
class Source:
    """A checkpoint URL opened for reading, with one version's manifest."""

    url: str
    reader: SnapshotReader
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def open_reader(url: str, threads: int = 4, storage_options: dict | None = None) -> SnapshotReader:
    """A reader on ``url``; :class:`BadUrl` when nothing is there."""
    try:
        reader = SnapshotReader(url, storage_options if storage_options is not None else STORAGE_OPTIONS or None,
                                threads=threads)
    except (ValueError, ImportError) as e:
        raise BadUrl(f"{url}: cannot open this URL ({e}); use a folder path, file://, s3://, or another "
                     "fsspec URL whose package is installed") from None
    if not reader.fs.exists(reader.root):
        raise BadUrl(f"{url}: no such checkpoint directory; check the path (it should contain step-* folders)")
    return reader


def open_source(spec: str, threads: int = 4, storage_options: dict | None = None) -> Source:
    """Open ``URL[@STEP]`` and read (and check) the chosen version's manifest."""
    url, step = split_version(spec)
    reader = open_reader(url, threads, storage_options)
    versions = reader.versions()
    if not versions:
        raise NoSnapshotFound(f"{url}: no snapshot versions (no step-* folders); is this the checkpoint root?", url)
    complete = [v.step for v in versions if v.complete]
    if step is None:
        if not complete:
            raise NoSnapshotFound(
                f"{url}: no complete version (versions {[v.step for v in versions]} all lack manifest.json: "
                "uploads cut short); nothing can be read", url)
    elif step not in {v.step for v in versions}:
        raise NoSnapshotFound(f"{url}: no version at step {step}; complete versions: {complete or 'none'}", url)
    elif step not in complete:
        raise SnapshotIncomplete(
            f"{url}: step {step} is incomplete (no manifest.json; an upload was cut short); complete versions: "
            f"{complete or 'none'}", reader.manifest_path(step))
    return Source(url, reader, reader.manifest(step))
