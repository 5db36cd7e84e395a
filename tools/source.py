"""Open ``URL[@STEP]``: a reader on the URL and the manifest of the chosen version.

``@STEP`` is optional; without it the newest complete version is used. A URL
that does not exist, a step that is not there and a URL without any version
each get their own clear error, naming what *is* there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from resilient.snapshot.api import (
    ChunkRecord, Manifest, NoSnapshotFound, SnapshotCorrupt, SnapshotIncomplete, TensorRecord,
)
from resilient.snapshot.format import parse_version_dir
from resilient.snapshot.reader import SnapshotReader
from resilient.snapshot.storage import with_retry

from resilient_tools.errors import BadUrl

_STEP = re.compile(r"^(.*)@(\d+|latest)$")

# fsspec storage options for every URL the tools open (``--storage-options`` sets them), e.g.
# ``{"client_kwargs": {"endpoint_url": "http://minio:9000"}}`` for an S3-compatible store.
STORAGE_OPTIONS: dict = {}
# The job secret the tools check versions with and sign what they write (``--secret-file``, or the
# environment's: resilient.secret.resolve_secret); None: CRCs only, and output unsigned.
SECRET = None


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


class CheckedReader(SnapshotReader):
    """A :class:`SnapshotReader` that checks a chunk's byte range against its object's size before reading it.

    Why: the manifest codec bounds an uncompressed chunk's ``length`` by its
    box, but a zstd chunk's ``length`` is free, and the range read asks storage
    for that many bytes at once: a garbled ``10**13`` made every tool die of
    MemoryError. A version's objects never change, so each size is asked once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sizes: dict[str, int | None] = {}

    def _object_size(self, path: str) -> int | None:
        if path not in self._sizes:
            try:
                self._sizes[path] = with_retry(lambda: self.fs.size(path), path, self.retry)
            except FileNotFoundError:
                raise SnapshotIncomplete(f"{path}: object is missing; the version is incomplete", path) from None
        return self._sizes[path]

    def read_chunk(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord):
        self.before_read(manifest, tensor, chunk)
        return super().read_chunk(manifest, tensor, chunk)

    def before_read(self, manifest: Manifest, tensor: TensorRecord, chunk: ChunkRecord) -> None:
        path = self.object_path(manifest, chunk)
        size = self._object_size(path)
        if size is not None and chunk.offset + chunk.length > size:
            raise SnapshotCorrupt(
                f"{path}: object is truncated: {size} bytes, the chunk of {tensor.name!r} at {list(chunk.offsets)} "
                f"needs bytes {chunk.offset}-{chunk.offset + chunk.length}; the object or the manifest is damaged",
                path)


def _parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."


def open_reader(url: str, threads: int = 4, storage_options: dict | None = None) -> SnapshotReader:
    """A reader on ``url``; :class:`BadUrl` when nothing is there, or when it is not a checkpoint folder."""
    try:
        reader = CheckedReader(url, storage_options if storage_options is not None else STORAGE_OPTIONS or None,
                               threads=threads, secret=SECRET)
    except (ValueError, ImportError) as e:
        raise BadUrl(f"{url}: cannot open this URL ({e}); use a folder path, file://, s3://, or another "
                     "fsspec URL whose package is installed") from None
    if not reader.fs.exists(reader.root):
        raise BadUrl(f"{url}: no such checkpoint directory; check the path (it should contain step-* folders)")
    # A manifest or a step folder is a common slip; without this, it read as "no versions".
    step = parse_version_dir(reader.root)
    if reader.fs.isfile(reader.root):
        inside = parse_version_dir(_parent(reader.root))
        root = _parent(_parent(url))
        hint = (f"'{root}' (or '{root}@{inside}' for this version)" if inside is not None
                else "the folder holding the step-* folders")
        raise BadUrl(f"{url}: is a file, not a checkpoint directory; give {hint}")
    if step is not None:
        raise BadUrl(f"{url}: is the folder of one version (step {step}), not the checkpoint directory; give its "
                     f"parent '{_parent(url)}' (or '{_parent(url)}@{step}' for this version)")
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
