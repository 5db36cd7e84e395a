"""The ``[snapshot]`` section of a run config."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from resilient.configbase import check_bounds, knob
from resilient.errors import ConfigError

# ``snapshot.every`` / ``snapshot.durable_every`` = "auto": the interval is chosen while the job
# runs (resilient.snapshot.interval), from what a version costs and how often the job fails.
AUTO = "auto"
# The largest chunk a writer may cut: what a reader accepts (resilient.snapshot.format.MAX_INFLATE,
# 1 GiB, refused above it before allocation), well under one AES-GMAC call's 2 GiB - 1.
MAX_CHUNK_MIB = 1024


def _interval(name: str, value: int | str) -> int | str:
    """A tier's interval knob: a number of steps (0 = off) or "auto"; a typo says so."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word == AUTO:
            return AUTO
        if word.isdigit():   # --set snapshot.every="10": a number written as a string
            return int(word)
        close = difflib.get_close_matches(word, [AUTO], n=1, cutoff=0.6)
        hint = f"; did you mean '{AUTO}'?" if close else ""
        raise ConfigError(f"'snapshot.{name}' = {value!r}: expected a number of steps (0 = off) or "
                          f"\"{AUTO}\" (chosen from each version's cost and the job's failure rate){hint}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"'snapshot.{name}' = {value!r}: expected a number of steps (0 = off) or \"{AUTO}\"")
    return value


@dataclass
class SnapshotConfig:
    """When and where training state is captured and kept."""

    every: int | str = knob(1, "capture a snapshot version every N optimizer steps into host RAM; 0 disables snapshots; \"auto\": the interval that fits the link and the job's failure rate (Young/Daly, bounded by auto_budget, auto_min_steps, auto_max_steps)")
    durable_url: str = knob("", "fsspec URL of the durable tier (file://, s3://, ...); empty = file://RUN_DIR/checkpoints")
    durable_every: int | str = knob(10, "upload every N-th step's version to the durable tier; 0 = only at the end and on preemption; \"auto\": chosen as for snapshot.every, from the upload's cost")
    auto_mtbf_hours: float = knob(24.0, "\"auto\" intervals: the mean time between failures assumed before the job has seen any (a prior; each restore after a failure or an SDC rollback pulls the estimate toward what the job sees)")
    auto_budget: float = knob(0.1, "\"auto\" intervals: the share of a link's time one tier's versions may take (peer RAM: the node's pushes to its peers; durable: the uploads); a version that takes longer widens the interval until it fits")
    auto_min_steps: int = knob(1, "\"auto\" intervals: never closer than this many steps")
    auto_max_steps: int = knob(1000, "\"auto\" intervals: never further apart than this many steps")
    durable_seconds: float = knob(0.0, "also upload when this many seconds passed since the last upload; 0 disables")
    keep_last: int = knob(3, "durable retention: keep the newest K complete versions")
    keep_every: int = knob(0, "durable retention: also keep every version whose step is a multiple of M; 0 disables")
    compress: str = knob("auto", "zstd for payloads: 'none', 'zstd', or 'auto' (zstd only for bf16/fp16 payloads to remote URLs, where it beats the link)", choices=("auto", "none", "zstd"))
    upload_threads: int = knob(4, "parallel chunk uploads to the durable tier")
    resume: bool = knob(True, "on start, restore the newest complete version found in the tiers")
    chunk_mib: int = knob(16, "durable format: cut each shard into chunks of at most this many MiB (one checksum and one MAC each; a resharding reader fetches at most one extra chunk per boundary); 1 to 1024: a reader refuses a chunk that claims more, and one AES-GMAC call takes under 2 GiB")
    part_mib: int = knob(64, "durable tier: pack a rank's chunks into objects of about this many MiB (one PUT and one retry unit each)")
    memory: bool = knob(True, "under `resilient launch`: write every captured version into the node's shared-memory store and replicate it to peers (local and peer RAM tiers)")
    store_dir: str = knob("/dev/shm", "tmpfs directory that holds the node store (STORE_DIR/resilient-u<uid>/resilient-<run_id>/<node>/: a 0700 root per user, checked before use; owned by you or root, sticky if others may write it)")
    store_keep: int = knob(2, "node store: keep the newest N versions (plus the newest committed one)")
    replicas: int = knob(1, "peer RAM: copies of each node's shards on other nodes (other failure domains first); 0 = local RAM only")
    replicate_mib_s: float = knob(0.0, "peer RAM: cap on each replication stream in MiB/s, so it shares the link with training; 0 = unlimited")
    replicate_duty: float = knob(0.1, "peer RAM budget: the share of wall time the agent may spend replicating and committing versions; when a version costs more, only every 2nd, 4th, ... version is replicated (up to replicate_max_stride); 1 = every version, whatever it costs")
    # 1 by default: the promise is at most one step lost per failure; on a
    # host where replication eats into training (2 shared cores) 2 halves its cost.
    replicate_max_stride: int = knob(1, "peer RAM budget: replicate at least every N-th version; 1 = every version (at most one step lost per failure); 2 = every 2nd when replication costs more than replicate_duty (a failure may lose one step more)")
    # The address peers are told, not every interface: a host's other networks (a management
    # or public one) never see the port (resilient.snapshot.peer, "Where it listens").
    store_host: str = knob("", "peer RAM: address the node store's server binds to, which peers are told; empty (the default) = this host's address (what its hostname resolves to: peers on other machines push and read there); 0.0.0.0 = every interface; every connection must prove the job secret either way")
    commit: str = knob("leader", "memory tiers' commit protocol: 'leader' (rank 0's node gathers every node's holds over the peer channel and commits: 2 etcd writes per version, whatever N) or 'etcd' (every node records its holds in etcd: N + 1 etcd writes and N² bytes per version; no leader)")

    def __post_init__(self) -> None:
        self.every = _interval("every", self.every)
        self.durable_every = _interval("durable_every", self.durable_every)
        # 0 means off (or unlimited) where the knob says so; a count of versions, threads or
        # chunk MiB below 1 would keep or move nothing.
        check_bounds(self, "snapshot",
                     at_least={"every": 0, "durable_every": 0, "durable_seconds": 0, "keep_every": 0,
                               "replicas": 0, "replicate_mib_s": 0, "keep_last": 1, "store_keep": 1,
                               "upload_threads": 1, "chunk_mib": 1, "part_mib": 1, "replicate_max_stride": 1},
                     above={"replicate_duty": 0}, at_most={"replicate_duty": 1})
        if not 0 < self.auto_budget <= 1:
            raise ConfigError(f"'snapshot.auto_budget' = {self.auto_budget!r}: expected a share of the link in (0, 1]")
        if not 1 <= self.auto_min_steps <= self.auto_max_steps:
            raise ConfigError(f"'snapshot.auto_min_steps' = {self.auto_min_steps}, 'snapshot.auto_max_steps' = "
                              f"{self.auto_max_steps}: expected 1 <= auto_min_steps <= auto_max_steps")
        if self.commit not in ("etcd", "leader"):
            raise ConfigError(f"'snapshot.commit' = {self.commit!r}: use 'etcd' or 'leader'")
        if isinstance(self.chunk_mib, bool) or not isinstance(self.chunk_mib, int) or not 1 <= self.chunk_mib <= MAX_CHUNK_MIB:
            raise ConfigError(f"'snapshot.chunk_mib' = {self.chunk_mib!r}: expected 1 to {MAX_CHUNK_MIB} MiB (a reader "
                              f"refuses a chunk that inflates to more: resilient.snapshot.format.MAX_INFLATE)")
        if isinstance(self.part_mib, bool) or not isinstance(self.part_mib, int) or self.part_mib < 1:
            raise ConfigError(f"'snapshot.part_mib' = {self.part_mib!r}: expected a size in MiB >= 1")
        if not self.auto_mtbf_hours > 0:
            raise ConfigError(f"'snapshot.auto_mtbf_hours' = {self.auto_mtbf_hours!r}: expected hours > 0")

    @property
    def memory_on(self) -> bool:
        """Whether the memory tiers (node RAM, peers) run: ``every`` not 0 and ``memory`` on."""
        return self.memory and (self.every == AUTO or self.every > 0)

    @property
    def auto_tiers(self) -> tuple[str, ...]:
        """The tiers whose interval is chosen while the job runs: ``memory``, ``durable``."""
        return tuple(t for t, v in (("memory", self.every), ("durable", self.durable_every)) if v == AUTO)
