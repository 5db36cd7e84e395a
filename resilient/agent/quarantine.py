"""Quarantine of nodes whose hardware computed wrong answers.

When the SDC monitor confirms a persistent fault (the same wrong answer on
replay, or a failed arithmetic probe), the worker on that device exits with
``WorkerExit.QUARANTINE`` (:mod:`resilient.contract`). Its agent records the node under
``/resilient/<run>/quarantine/<node>`` and leaves the job; the other nodes
re-form without it and roll back (with fewer than the job's minimum left, the
job stops here: the launcher says so, and how to clear or replace the node).
An agent refuses to start on a quarantined node until an operator, having
checked or replaced the hardware, clears the record::

    resilient quarantine list  --run-dir RUN_DIR
    resilient quarantine clear NODE --run-dir RUN_DIR
    resilient quarantine clear NODE --rdzv-endpoint HOST:PORT --run-id RUN --durable-url URL   (another machine)

The records live in the run's ledger (:mod:`resilient.ledger`): in etcd, in the
node's run dir (``RUN_DIR/ledger``) and on the durable tier, so they outlive the
etcd that held them (a relaunch of a one-machine job, whose embedded etcd went
with it, is refused too; another machine finds the durable tier's copy). Each
record carries a MAC under the job secret (:mod:`resilient.secret`, bound to the
record's key) and a generation: a clear is a newer record saying ``cleared``, in
every copy the CLI reaches, so a genuine old record put back in etcd is older
than the clear and changes nothing; a forged one is reported (``auth_failure``)
and ignored, and deleting etcd's copy leaves the others. The CLI takes the job
secret (``--secret-file``, ``--run-dir`` or the environment) and the TLS/auth
keys of ``--rdzv-conf``, as ``launch`` does; on a single-machine job
``--run-dir`` alone finds the records, the secret, the run id and, while it is
up, the embedded etcd (named in ``RUN_DIR/control/etcd.json``; reached with the client
certificate and login derived from the secret).

A node the fail-slow checks found slow (``failslow.policy = "replace"``) takes
the same path, lighter: its workers exit with ``WorkerExit.SLOW``, its agent
records a mark under ``/resilient/<run>/slow/<node>`` (:class:`SlowMarks`, the
same sealed records), leaves the round so a spare takes the seat, and clears
the mark itself once a probe run shows the node healthy
(:mod:`resilient.failslow.replace`): no operator needed.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from resilient.agent.api import AgentError
from resilient.etcd import EtcdClient
from resilient.ledger import Copy, EtcdCopy, Ledger
from resilient.secret import QUARANTINE, JobSecret, require_secret

class NodeQuarantined(AgentError):
    """This node is quarantined; an operator must clear it first."""


PURPOSE = QUARANTINE
QUARANTINED, CLEARED = "quarantined", "cleared"   # a record's state; a clear is a newer record, never a delete


def _order(doc: dict) -> int:
    """Two records of one generation (written at once): the quarantine wins, the safe side."""
    return 0 if doc.get("state") == CLEARED else 1


def is_quarantined(doc: dict | None) -> bool:
    return doc is not None and doc.get("state", QUARANTINED) != CLEARED


class Quarantine:
    """The quarantine records of a run, in the ledger (:mod:`resilient.ledger`): in etcd
    (``client``; None: the copies alone, an operator's CLI after the job's embedded etcd is
    gone) and in ``copies`` (:func:`resilient.ledger.run_copies`: the run dir's and the durable
    tier's, where a relaunch finds them). ``secret``: the job secret (default: from the
    environment, :func:`resilient.secret.require_secret`)."""

    KIND = "quarantine"   # the records' directory under /resilient/<run>/

    def __init__(self, client: EtcdClient | None, run_id: str, secret: JobSecret | bytes | None = None,
                 events: Any = None, copies: Iterable[Copy] = ()):
        self.client = client
        self.run_id = run_id
        self._secret = JobSecret.of(secret) if secret is not None else None
        self.events = events
        self.prefix = f"/resilient/{run_id}/{self.KIND}/"
        self._etcd = EtcdCopy(client) if client is not None else None
        self.ledger = Ledger(PURPOSE, lambda: self.secret, ([self._etcd] if self._etcd else []) + list(copies),
                             events, f"{self.KIND} record", _order)

    @property
    def secret(self) -> JobSecret:
        """Resolved when first needed."""
        if self._secret is None:
            self._secret = require_secret(what="the quarantine")
        return self._secret

    @property
    def where(self) -> list[str]:
        """The copies this book reads and writes (``etcd``, ``run dir ...``, ``durable tier ...``)."""
        return [c.where for c in self.ledger.copies]

    def add(self, node: str, **record) -> list[str]:
        """Quarantine ``node`` in every copy (the ones written are returned)."""
        return self.ledger.write(self.prefix + node, {"node": node, "time": time.time(), **record,
                                                      "state": QUARANTINED}, strict=None)

    def get(self, node: str) -> dict | None:
        """The node's quarantine record, newest over the copies, or None (none, cleared since, or
        none that authenticates). etcd unreachable raises, as the client does."""
        doc, _ = self.ledger.read(self.prefix + node, strict=self._etcd)
        return doc if is_quarantined(doc) else None

    def scan(self) -> tuple[dict[str, dict], dict[str, str]]:
        """(node → its quarantine record, node → why its records fail authentication)."""
        good, forged = self.ledger.scan(self.prefix, strict=self._etcd)
        return {n: d for n, d in good.items() if is_quarantined(d)}, forged

    def all(self) -> dict[str, dict]:
        return self.scan()[0]

    def clear(self, node: str) -> bool:
        """Whether ``node`` was quarantined; if so, a newer record says it is cleared, in every
        copy (a writer of etcd who puts the old record back does not undo it: the ledger)."""
        doc, _ = self.ledger.read(self.prefix + node, strict=self._etcd)
        if not is_quarantined(doc):
            return False
        self.ledger.write(self.prefix + node, {"node": node, "time": time.time(), "state": CLEARED,
                                               "was": {k: doc.get(k) for k in ("time", "reason", "device")}},
                          strict=self._etcd)
        return True

    def refuse_if_quarantined(self, node: str, how_to_clear: str) -> None:
        """:class:`NodeQuarantined` if ``node`` is; ``how_to_clear``: the options of
        ``resilient quarantine clear NODE ...`` that reach this run."""
        record = self.get(node)
        if record is not None:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("time", 0)))
            raise NodeQuarantined(
                f"node {node!r} is quarantined since {since} ({record.get('reason', 'silent data corruption')}, "
                f"device {record.get('device', '?')}): it is not trained on until an operator, after checking or "
                f"replacing its hardware, clears it with `resilient quarantine clear {node} {how_to_clear}`")


class SlowMarks(Quarantine):
    """Nodes marked slow by the fail-slow ``replace`` policy (module doc): records as a
    quarantine's, in their own directory, so a marked node is never refused a start: its
    agent probes it and clears the mark when it is healthy."""

    KIND = "slow"
