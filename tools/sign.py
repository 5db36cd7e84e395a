"""``ckpt sign``: adopt a version written without MACs (before authenticated versions, or
by a job without a secret) for a job secret.

A job that holds a secret loads only versions that authenticate under it
(:mod:`resilient.snapshot.auth`): an unsigned version is refused
(``SnapshotUnsigned``), since nothing tells it from a forgery. An operator who trusts
one (their own checkpoint, written before the upgrade) signs it: every chunk is read,
checked against its CRC (integrity: a damaged version is not adopted), inflated a
bounded piece at a time if compressed, and given its MAC; then ``manifest.json`` is
rewritten, signed, atomically (read back and compared). Objects are not rewritten.

Signing asserts trust; it does not create it. Sign only what you wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from resilient.snapshot.api import Manifest, SnapshotError
from resilient.snapshot.auth import VersionAuth
from resilient.snapshot.format import inflate_pieces, manifest_to_json, verify
from resilient.snapshot.reader import SnapshotReader
from resilient.snapshot.storage import read_range, with_retry, write_object

from resilient_tools.errors import CkptToolError
from resilient_tools.progress import Progress


@dataclass
class SignResult:
    url: str
    step: int
    chunks: int
    bytes_read: int
    resigned: bool


def sign(reader: SnapshotReader, step: int, auth: VersionAuth, *, force: bool = False,
         progress: bool = True) -> SignResult:
    """Sign version ``step`` under ``reader`` (opened without a secret) for ``auth``'s secret.
    ``force``: also re-sign a version that carries MACs (for another secret)."""
    path = reader.manifest_path(step)
    raw = with_retry(lambda: reader.fs.cat_file(path), path, reader.retry)
    signed = b'"mac":"hmac-sha256:' in raw[-100:]
    if signed and not force:
        try:
            auth.open_manifest(raw, path)
        except SnapshotError:
            raise CkptToolError(f"{path}: already signed, but not with this secret; pass --force to re-sign it "
                                "for this one (only if you trust its content)") from None
        m = reader.manifest(step)
        return SignResult(reader.url, step, sum(len(t.chunks) for t in m.tensors.values()), 0, False)
    m: Manifest = reader.manifest(step)
    total = sum(c.length for t in m.tensors.values() for c in t.chunks)
    bar = Progress(f"sign step {step}", total, progress)
    tensors = {}
    for name, t in m.tensors.items():
        chunks = []
        for c in t.chunks:
            obj = reader.object_path(m, c)
            where = f"{obj}@{c.offset}+{c.length} ({name})"
            stored = with_retry(lambda: read_range(reader.fs, obj, c.offset, c.offset + c.length), obj, reader.retry)
            verify(stored, c.checksum, where)  # a damaged chunk is not adopted
            if c.compression == "none":
                mac = auth.chunk_mac(step, c.object.split("/", 1)[0], stored)
            else:
                mac = auth.chunk_mac_pieces(step, c.object.split("/", 1)[0],
                                            inflate_pieces(stored, c.raw_length, where))
            chunks.append(replace(c, mac=mac))
            bar.advance(c.length)
        tensors[name] = replace(t, chunks=chunks)
    bar.close()
    doc = auth.sign_manifest(manifest_to_json(replace(m, tensors=tensors)))

    def put_and_check() -> None:
        write_object(reader.fs, path, [doc], len(doc))
        if reader.fs.cat_file(path) != doc:
            raise OSError(f"{path}: manifest read back differs from what was written")

    with_retry(put_and_check, path, reader.retry)
    return SignResult(reader.url, step, sum(len(t.chunks) for t in tensors.values()), bar.done, signed)
