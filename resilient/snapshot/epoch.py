"""The run's epoch: which memory commit records a restore may still trust after a rollback.

Why: a rollback (an SDC rollback to the last verified version, or a restore that goes back
past newer records its holders can no longer serve) deletes the commit records of the
versions after it, so that no restart loads that abandoned future. A record's MAC proves
who wrote it, not that it is still current: a writer of etcd who saved one could put it
back, genuine, and a later restore would load it. So every commit record carries the
*epoch* it was made in (``"epoch"``; 0 for records from before epochs), and every rollback
raises the epoch and notes the step it kept. The epoch record (``/resilient/<run>/commit/epoch``,
sealed as commit records are) is kept in the run's ledger (:mod:`resilient.ledger`): etcd,
the run dir of the node that rolled back, and the durable tier, the highest generation
winning, so that putting back or deleting etcd's copy does not roll it back::

    {"gen": E, "floors": [[e, s], ...], "since": F, "time": t}

``gen`` is the epoch; ``[e, s]``: the rollback that began epoch ``e`` kept the steps up to
``s``; ``since``: the floors of every epoch after ``F`` are listed (the oldest are dropped
beyond :data:`MAX_FLOORS`). A commit of step ``s`` made in epoch ``c`` is *abandoned* when
a rollback of a later epoch kept less (``s > floor(e)`` for some ``e > c``), or when ``c``
is older than ``since``. Readers (:func:`resilient.snapshot.commits.read_commits`) leave abandoned records out and
report each (``auth_failure``, ``what = "abandoned commit record"``): after the fence below
one only appears by being put back.

The committers' fence (:class:`EpochFence`): each commit transaction also compares the
epoch key's revision with the one the committer knows, so a commit racing a rollback fails;
the committer then learns the new epoch and drops the versions that landed before it
learned of it above the new floor (they belong to the abandoned future), and commits the
others in the new epoch. No extra etcd request in the common path.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from resilient.ledger import Copy, EtcdCopy, Ledger
from resilient.secret import COMMIT, JobSecret, Unauthentic, report_unauthentic

log = logging.getLogger(__name__)

MAX_FLOORS = 256


def epoch_key(run_id: str) -> str:
    return f"/resilient/{run_id}/commit/epoch"


@dataclass(frozen=True)
class Epoch:
    """The run's epoch and the floors of its rollbacks (module docstring); pure."""

    gen: int = 0
    floors: tuple[tuple[int, int], ...] = ()
    since: int = 0

    def cap(self, made_in: int) -> int | None:
        """The highest step a commit made in epoch ``made_in`` may hold (None: any)."""
        caps = [s for e, s in self.floors if e > made_in]
        return min(caps) if caps else None

    def admits(self, step: int, made_in: int) -> bool:
        """Whether a commit of ``step`` made in epoch ``made_in`` is not abandoned."""
        if made_in < self.since:
            return False
        cap = self.cap(made_in)
        return cap is None or step <= cap

    def rolled_back(self, floor: int) -> "Epoch":
        """The next epoch, begun by a rollback that keeps the steps up to ``floor``."""
        floors = self.floors + ((self.gen + 1, floor),)
        since = self.since
        if len(floors) > MAX_FLOORS:
            dropped, floors = floors[:-MAX_FLOORS], floors[-MAX_FLOORS:]
            since = max(since, dropped[-1][0])
        return Epoch(self.gen + 1, floors, since)

    def to_doc(self) -> dict:
        return {"gen": self.gen, "floors": [list(f) for f in self.floors], "since": self.since}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any] | None) -> "Epoch":
        """The epoch of an authentic record; a malformed one (a bug, never a forgery: it
        authenticated) is the newest epoch with every step abandoned, the safe side."""
        if doc is None:
            return cls()
        try:
            gen, since = int(doc.get("gen", 0)), int(doc.get("since", 0))
            floors = tuple((int(e), int(s)) for e, s in doc.get("floors") or ())
        except (TypeError, ValueError):
            return cls(gen=10 ** 9, floors=((10 ** 9, -1),), since=10 ** 9)
        return cls(gen, floors, since)


def made_in(record: Mapping[str, Any]) -> int:
    e = record.get("epoch", 0)
    return e if isinstance(e, int) and not isinstance(e, bool) else -1


def rollback_order(doc: Mapping[str, Any]) -> int:
    """Two rollbacks that wrote one generation at once: the one that kept less wins."""
    floors = doc.get("floors") or [[0, 0]]
    try:
        return -int(floors[-1][1])
    except (TypeError, ValueError, IndexError):
        return 0


def epoch_ledger(client: Any, secret: JobSecret | bytes, copies: Iterable[Copy] = (), events: Any = None) -> Ledger:
    secret = JobSecret.of(secret)
    return Ledger(COMMIT, lambda: secret, ([EtcdCopy(client)] if client is not None else []) + list(copies),
                  events, "commit epoch record", rollback_order)


def _range_op(lo: str, hi: str) -> dict:
    return {"request_delete_range": {"key": base64.b64encode(lo.encode()).decode(),
                                     "range_end": base64.b64encode(hi.encode()).decode()}}


def abandon_after(client, run_id: str, secret: JobSecret | bytes, step: int, prefixes: Iterable[str],
                  copies: Iterable[Copy] = (), events: Any = None, always: bool = True) -> Epoch | None:
    """A rollback to ``step``: the next epoch (floor ``step``) in every copy of the ledger, then
    the commit records of later steps deleted (under ``prefixes``: their keys end in the step,
    12 digits). ``always=False``: only when there are such records (a restore that went back
    past nothing changes nothing). The new epoch, or None."""
    bounds = [(f"{prefix}{step + 1:012d}", f"{prefix}~") for prefix in prefixes]
    if not always:
        counts = client.txn([], [{"request_range": {**_range_op(lo, hi)["request_delete_range"], "count_only": True}}
                                 for lo, hi in bounds], [])
        if not any(int((r.get("response_range") or r.get("responseRange") or {}).get("count", 0))
                   for r in counts.get("responses") or []):
            return None
    ledger = epoch_ledger(client, secret, copies, events)
    current, _ = ledger.read(epoch_key(run_id), strict=ledger.copies[0])
    new = Epoch.from_doc(current).rolled_back(step)
    ledger.write(epoch_key(run_id), {**new.to_doc(), "time": time.time()}, strict=ledger.copies[0])
    client.txn([], [_range_op(lo, hi) for lo, hi in bounds], [])
    return new


class EpochFence:
    """A committer's view of the epoch (module docstring): what it seals its records with, the
    compare its commit transactions carry, and which versions a rollback it learned of abandons."""

    def __init__(self, client, run_id: str, secret: JobSecret | bytes, events: Any = None):
        self.client, self.key = client, epoch_key(run_id)
        self._secret, self._events = JobSecret.of(secret), events
        self.epoch, self.revision, self.learned_at = Epoch(), 0, 0.0
        self._newest_floor: int | None = None
        self._known = False

    @classmethod
    def start(cls, client, run_id: str, secret: JobSecret | bytes, events: Any = None) -> "EpochFence":
        """A fence that knows the epoch from now (etcd unreachable: from its first commit)."""
        fence = cls(client, run_id, secret, events)
        try:
            fence.refresh()
        except Exception as e:   # the first commit asks again, and says so if it fails
            log.debug("could not read the run's epoch yet: %s", e)
        return fence

    def _learn(self, kv) -> None:
        """Take etcd's copy ``kv`` (None: absent), if newer than what is known. etcd's alone: a
        copy an etcd writer rolled back only makes this committer seal in an older epoch, whose
        records the readers (who read every copy) refuse: a loss of memory commits, not of safety."""
        self.revision = kv.mod_revision if kv is not None else 0
        best = Epoch()
        if kv is not None:
            try:
                best = Epoch.from_doc(self._secret.open_record(COMMIT, self.key, kv.value))
            except Unauthentic as e:   # forged: what we knew still holds
                report_unauthentic(self._events, "commit epoch record", self.key, e)
        if best.gen > self.epoch.gen:
            # news only once something was known: what the first read finds was there before
            # this committer's versions (a new agent's store holds none of an older epoch's)
            self.epoch, self.learned_at = best, time.time() if self._known else 0.0
            self._newest_floor = best.floors[-1][1] if best.floors else None
        self._known = True

    def refresh(self) -> None:
        self._learn(self.client.get(self.key))

    def abandons(self, step: int, landed: float) -> bool:
        """Whether a version of ``step`` that landed at ``landed`` (its files' mtime, this
        machine's clock) belongs to a future a rollback abandoned: above the newest floor, and
        landed before this committer learned of that rollback."""
        if not self._known:
            self.refresh()
        return self._newest_floor is not None and step > self._newest_floor and landed < self.learned_at

    def create(self, records: Mapping[str, str]) -> set[str] | None:
        """Create each of ``records`` that does not exist yet (all in one transaction when none
        does; else each alone, as another committer may have made some), each only while the
        epoch is the one known. The keys created, or None when the epoch moved (learned now:
        ask :meth:`abandons` again and seal in the new epoch)."""
        if not self._known:
            self.refresh()
        if len(records) > 1:
            got = self._create(records, list(records))
            if got is None or got:
                return None if got is None else set(records)
        won = set()
        for key in records:
            got = self._create(records, [key])
            if got is None:
                return None
            if got:
                won.add(key)
        return won

    def _create(self, records: Mapping[str, str], keys: list[str]) -> bool | None:
        def b64(s: str) -> str:
            return base64.b64encode(s.encode()).decode()

        compare = [{"key": b64(self.key), "target": "MOD", "result": "EQUAL", "mod_revision": self.revision}]
        compare += [{"key": b64(k), "target": "VERSION", "result": "EQUAL", "version": 0} for k in keys]
        puts = [{"request_put": {"key": b64(k), "value": b64(records[k])}} for k in keys]
        got = self.client.txn(compare, puts, [{"request_range": {"key": b64(self.key)}}])
        if got.get("succeeded"):
            return True
        responses = got.get("responses") or [{}]
        read = responses[0].get("response_range") or responses[0].get("responseRange") or {}
        kvs = read.get("kvs") or []
        if (int(kvs[0].get("mod_revision", 0)) if kvs else 0) != self.revision:
            self.refresh()   # a rollback (or a write of etcd's copy by anyone): learn what holds
            return None
        return False
