"""Snapshots of sharded training state: the format, capture, tiers, restore.

- :class:`Snapshotter`     save (async) / restore for a training loop
- :class:`SnapshotReader`  streaming reads for tools: versions, manifests, regions
- :mod:`.api`              records and typed errors; docs/format.md: the format
- :mod:`.auth`             every version signed with the job secret (manifest HMAC, chunk GMAC)
"""

import importlib

# Lazy (PEP 562): ``resilient.snapshot.config`` is read while a run config is checked, before
# anything imports torch (a typo is answered at once); these names pull in the format, so torch.
_WHERE = {
    **dict.fromkeys(("ChunkRecord", "FormatVersionError", "Manifest", "NoSnapshotFound", "Restored",
                     "SnapshotCorrupt", "SnapshotError", "SnapshotIncomplete", "SnapshotMismatch",
                     "StorageError", "TensorRecord"), "api"),
    **dict.fromkeys(("SnapshotUnauthentic", "SnapshotUnsigned", "VersionAuth"), "auth"),
    "Box": "boxes", "SnapshotReader": "reader", "VersionInfo": "reader", "collect_garbage": "retention",
    "rng_state": "rng", "set_rng_state": "rng", "Snapshotter": "snapshotter", "RetryPolicy": "storage",
}

__all__ = [
    "Snapshotter", "SnapshotReader", "VersionInfo", "Box", "RetryPolicy", "Restored", "collect_garbage",
    "rng_state", "set_rng_state", "Manifest", "TensorRecord", "ChunkRecord",
    "SnapshotError", "SnapshotCorrupt", "SnapshotIncomplete", "SnapshotMismatch",
    "FormatVersionError", "NoSnapshotFound", "StorageError", "SnapshotUnauthentic", "SnapshotUnsigned", "VersionAuth",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'resilient.snapshot' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"resilient.snapshot.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
