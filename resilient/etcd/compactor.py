"""Compaction of etcd's history, so that a long job does not fill etcd's space quota.

Why: etcd keeps every past value of every key until the history is compacted.
A job that snapshots every step writes etcd records every step (holds and
commits of each version, keep-alives, heartbeats): measured on the 2-node
demo, 2.2 KB of etcd database per step, ~0.5 GB a day, and the commit
records grow with the world size. etcd's default quota is 2 GiB; past it etcd
refuses every write (the NOSPACE alarm), so rendezvous, leases and commits
all fail and the job stops until an operator compacts, defragments and
disarms the alarm. etcd compacts itself only when started with
``--auto-compaction-*``, which a cluster we are pointed at may not be.

So each agent compacts on a timer, as Kubernetes' API server does for its
etcd: every ``interval`` it compacts up to the revision it saw one interval
earlier, which keeps at least one interval of history for any other client's
watches. Several agents doing the same is harmless: compacting to a revision
already compacted is refused and ignored. Compaction frees space inside the
database for reuse; it does not shrink the file (``etcdctl defrag`` does).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from resilient.etcd.api import EtcdAuthError

log = logging.getLogger(__name__)


class HistoryCompactor:
    """A daemon thread compacting ``client``'s cluster every ``interval`` (see the module
    docstring). ``key``: one the job may read (the revision comes with any read).
    ``start=False``: no thread; the caller runs the rounds (:meth:`tick`)."""

    def __init__(self, client, interval: timedelta, key: str = "/resilient/", start: bool = True):
        if interval <= timedelta(0):
            raise ValueError(f"compaction interval must be positive, got {interval}")
        self.client, self.interval, self.key = client, interval, key
        self.compacted: int | None = None  # the newest revision this compactor compacted to
        self._seen: int | None = None
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-compactor", daemon=True)
        if start:
            self._thread.start()

    def tick(self) -> None:
        """One round: compact to the revision seen the round before, then note the current one."""
        now = self.client.revision(self.key)
        if self._seen is not None and self._seen > now:  # a new cluster (its data lost): start over
            self._seen, self.compacted = None, None
        if self._seen is not None and self._seen > (self.compacted or 0):
            if self.client.compact(self._seen):
                log.info("compacted etcd history before revision %d", self._seen)
            self.compacted = self._seen
        self._seen = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval.total_seconds()):
            try:
                self.tick()
            except Exception as e:  # etcd away for a while: the next round tries again
                kind = type(e).__name__
                if kind in self._warned:
                    log.debug("etcd compaction skipped: %s", e)
                    continue
                self._warned.add(kind)  # once per kind: an etcd that is down says so elsewhere
                hint = (" (this etcd user may not compact: have its operators compact it or run etcd with "
                        "--auto-compaction-retention, and set launch.etcd_compact_interval=0)"
                        if isinstance(e, EtcdAuthError) else "")
                log.warning("could not compact etcd's history, retrying every %s: %s%s", self.interval, e, hint)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
