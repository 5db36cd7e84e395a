"""Snapshots of sharded training state: the format, capture, tiers, restore.

- :class:`Snapshotter`     save (async) / restore for a training loop
- :class:`SnapshotReader`  streaming reads for tools: versions, manifests, regions
- :mod:`.api`              records and typed errors; docs/format.md: the format
- :mod:`.auth`             every version signed with the job secret (manifest HMAC, chunk GMAC)
"""

from resilient.snapshot.api import (
    ChunkRecord, FormatVersionError, Manifest, NoSnapshotFound, Restored, SnapshotCorrupt,
    SnapshotError, SnapshotIncomplete, SnapshotMismatch, StorageError, TensorRecord,
)
from resilient.snapshot.auth import SnapshotUnauthentic, SnapshotUnsigned, VersionAuth
from resilient.snapshot.boxes import Box
from resilient.snapshot.reader import SnapshotReader, VersionInfo
from resilient.snapshot.retention import collect_garbage
from resilient.snapshot.rng import rng_state, set_rng_state
from resilient.snapshot.snapshotter import Snapshotter
from resilient.snapshot.storage import RetryPolicy

__all__ = [
    "Snapshotter", "SnapshotReader", "VersionInfo", "Box", "RetryPolicy", "Restored", "collect_garbage",
    "rng_state", "set_rng_state", "Manifest", "TensorRecord", "ChunkRecord",
    "SnapshotError", "SnapshotCorrupt", "SnapshotIncomplete", "SnapshotMismatch",
    "FormatVersionError", "NoSnapshotFound", "StorageError", "SnapshotUnauthentic", "SnapshotUnsigned", "VersionAuth",
]
