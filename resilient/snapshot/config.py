"""The ``[snapshot]`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass

from resilient.configbase import knob


@dataclass
class SnapshotConfig:
    """When and where training state is captured and kept."""

    every: int = knob(1, "capture a snapshot version every N optimizer steps into host RAM; 0 disables snapshots")
    durable_url: str = knob("", "fsspec URL of the durable tier (file://, s3://, ...); empty = file://RUN_DIR/checkpoints")
    durable_every: int = knob(10, "upload every N-th step's version to the durable tier; 0 = only at the end and on preemption")
    durable_seconds: float = knob(0.0, "also upload when this many seconds passed since the last upload; 0 disables")
    keep_last: int = knob(3, "durable retention: keep the newest K complete versions")
    keep_every: int = knob(0, "durable retention: also keep every version whose step is a multiple of M; 0 disables")
    compress: str = knob("auto", "zstd for payloads: 'none', 'zstd', or 'auto' (zstd only for bf16/fp16 payloads to remote URLs, where it beats the link)", choices=("auto", "none", "zstd"))
    upload_threads: int = knob(4, "parallel chunk uploads to the durable tier")
    resume: bool = knob(True, "on start, restore the newest complete version found in the tiers")
    chunk_mib: int = knob(16, "durable format: cut each shard into chunks of at most this many MiB (one checksum each; a resharding reader fetches at most one extra chunk per boundary)")
    part_mib: int = knob(64, "durable tier: pack a rank's chunks into objects of about this many MiB (one PUT and one retry unit each)")
    memory: bool = knob(True, "under `resilient launch`: write every captured version into the node's shared-memory store and replicate it to peers (local and peer RAM tiers)")
    store_dir: str = knob("/dev/shm", "tmpfs directory that holds the node store (STORE_DIR/resilient-<run_id>/<node>/)")
    store_keep: int = knob(2, "node store: keep the newest N versions (plus the newest committed one)")
    replicas: int = knob(1, "peer RAM: copies of each node's shards on other nodes (other failure domains first); 0 = local RAM only")
    replicate_mib_s: float = knob(0.0, "peer RAM: cap on each replication stream in MiB/s, so it shares the link with training; 0 = unlimited")
    replicate_duty: float = knob(0.1, "peer RAM budget: the share of wall time the agent may spend replicating and committing versions; when a version costs more, only every 2nd, 4th, ... version is replicated (up to replicate_max_stride); 1 = every version, whatever it costs")
    # 1 by default: the promise is at most one step lost per failure; on a
    # host where replication eats into training (2 shared cores) 2 halves its cost.
    replicate_max_stride: int = knob(1, "peer RAM budget: replicate at least every N-th version; 1 = every version (at most one step lost per failure); 2 = every 2nd when replication costs more than replicate_duty (a failure may lose one step more)")
    store_host: str = knob("0.0.0.0", "peer RAM: address the node store's server binds to")
