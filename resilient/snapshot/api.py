"""The snapshot subsystem's typed records and errors.

Everything another part of resilient (the tiers, the checkpoint tools, the
training loop) needs to talk about a snapshot lives here: the records of the
on-storage format (:class:`Manifest`, :class:`TensorRecord`,
:class:`ChunkRecord`), what a restore returns (:class:`Restored`), and the
errors, each of which says what to do about it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resilient.errors import ResilientError

__all__ = [
    "SnapshotError", "SnapshotCorrupt", "SnapshotIncomplete", "SnapshotMismatch",
    "FormatVersionError", "NoSnapshotFound", "StorageError",
    "ChunkRecord", "TensorRecord", "Manifest", "Restored", "CommitProtocol",
]

if TYPE_CHECKING:
    from resilient.snapshot.nodestore import LocalVersion

# A version's directory: VERSION_PREFIX + the step, zero-padded (format.version_dir). Here, not in
# .format: the preflight counts the durable tier's versions before anything imports torch.
VERSION_PREFIX = "step-"


class SnapshotError(ResilientError):
    """Base of every snapshot error. ``obj`` names the object (URL or path) at fault."""

    def __init__(self, message: str, obj: str | None = None):
        super().__init__(message)
        self.obj = obj


class SnapshotCorrupt(SnapshotError):
    """Bytes read back do not match their checksum or cannot be decoded.

    The version is unusable; restore falls back to the previous complete one.
    Delete the named version (``resilient ckpt gc``) once the cause (disk,
    network, a peer handing back bad bytes) is understood."""


class SnapshotIncomplete(SnapshotError):
    """A version lacks an object or does not cover every element of a tensor.

    Usually a version whose upload was cut short or partly deleted by hand;
    restore falls back to the previous complete version."""


class SnapshotMismatch(SnapshotError):
    """The checkpoint is of another model: a name, shape, dtype or config digest differs.

    Point the run at the right checkpoint URL, or start fresh (resume off)."""


class FormatVersionError(SnapshotError):
    """The manifest was written by a newer resilient; upgrade resilient to read it."""


class NoSnapshotFound(SnapshotError):
    """No complete version exists at the URL (or none could be read)."""


class StorageError(SnapshotError):
    """Storage kept failing after every retry; check the URL, credentials and network."""


@dataclass(frozen=True)
class ChunkRecord:
    """One stored box of a tensor: ``sizes`` elements at global ``offsets``.

    Its bytes are ``length`` bytes at byte ``offset`` of ``object`` (a path
    relative to the version directory), row-major, little-endian; after
    decompression they are ``raw_length`` bytes. ``checksum`` covers the
    stored (possibly compressed) bytes; ``mac`` (``""`` in an unsigned version)
    authenticates the raw bytes under the job secret (:mod:`resilient.snapshot.auth`)."""

    object: str
    offset: int
    length: int
    raw_length: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    checksum: str
    compression: str = "none"
    mac: str = ""

    def to_json(self) -> dict:
        doc = {"object": self.object, "offset": self.offset, "length": self.length,
               "raw_length": self.raw_length, "offsets": list(self.offsets),
               "sizes": list(self.sizes), "checksum": self.checksum,
               "compression": self.compression}
        if self.mac:
            doc["mac"] = self.mac
        return doc


@dataclass
class TensorRecord:
    """A tensor by its global name: global shape, dtype and the chunks that tile it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: list[ChunkRecord] = field(default_factory=list)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Manifest:
    """The JSON manifest of one version (or of one rank's part of it).

    ``rank`` is None for the global manifest, the writing rank for a rank
    manifest. ``rank_extras`` maps each writer rank to its JSON extra state
    (RNG states, ...); ``extra`` is the global JSON extra state."""

    step: int
    world: int
    layout: dict[str, Any]
    config_digest: str
    attempt: str
    tensors: dict[str, TensorRecord]
    values: dict[str, Any] = field(default_factory=dict)
    rank_extras: dict[int, Any] = field(default_factory=dict)
    extra: Any = None
    created: float = 0.0
    rank: int | None = None
    format_version: int = 1
    # The run's rollback epoch its writer knew (rank 0's: :mod:`resilient.snapshot.epoch`): a
    # version of a future a later rollback abandoned is refused, even when put back genuine.
    epoch: int = 0

    @property
    def nbytes(self) -> int:
        """Stored bytes of all chunks."""
        return sum(c.length for t in self.tensors.values() for c in t.chunks)

    @property
    def objects(self) -> list[str]:
        return sorted({c.object for t in self.tensors.values() for c in t.chunks})


@dataclass
class Restored:
    """What :meth:`Snapshotter.restore` returns.

    ``extra`` is the JSON extra this rank saved when the writer had a rank of
    the same number (None otherwise: the layout shrank); ``rank_extras`` has
    every writer rank's; ``global_extra`` is the global extra; ``layout`` and
    ``world`` are the writer's."""

    step: int
    extra: Any
    global_extra: Any
    rank_extras: dict[int, Any]
    layout: dict[str, Any]
    world: int
    url: str
    resharded: bool


class CommitProtocol(ABC):
    """How a node's replicator (:class:`~resilient.snapshot.memcommit.Replicator`, one per
    agent) has the fleet's holds of a version gathered and the version committed, after it
    pushed its own ranks' replicas. A replicator holds one, composed, not inherited:

    * :class:`~resilient.snapshot.etcdcommit.EtcdCommit`: every node records its holds in
      etcd and whoever sees every rank held commits (N + 1 etcd writes per version);
    * :class:`~resilient.snapshot.leadcommit.LeaderCommit`: the node of rank 0 chooses the
      version, the others report their holds to it over the peer channel, it alone commits
      (one etcd transaction per version).

    Called from the replicator's thread only, in this order per turn: :meth:`following`
    (and :meth:`follow`) to choose the version, :meth:`begin` before the push,
    :meth:`commit` after it."""

    def following(self, attempt: str) -> bool:
        """Whether this node handles another node's choice of version of ``attempt``, not its
        own newest (then :meth:`follow` chooses)."""
        return False

    def follow(self, newest: "LocalVersion") -> "LocalVersion | None":
        """The version to handle now, ``newest`` being this node's newest one not handled; None
        when there is none yet (after a wait) or the ones here were given up."""
        return newest

    def begin(self, v: "LocalVersion") -> None:
        """``v`` is the version handled now; its replicas are pushed next."""

    @abstractmethod
    def commit(self, v: "LocalVersion", world: int, holders: dict[int, list[str]], manifests: dict[int, bytes],
               parsed: dict[int, dict], tiers: dict[str, int]) -> None:
        """After the push: this node holds ``holders`` (its ranks of ``v``, each on these nodes),
        whose signed rank manifests are ``manifests`` (``parsed``: those parsed so far); gather
        the other nodes' holds and commit ``v`` at each tier of ``tiers`` (tier -> k) whose
        copies are all held, or leave that to the node that does."""
