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

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from resilient.agent.api import AgentError
from resilient.contract import check_name, default_run_id   # ids name the records' files too (resilient.ledger)
from resilient.etcd import EtcdAuthError, EtcdClient, EtcdError, EtcdUnavailable
from resilient.ledger import Copy, EtcdCopy, Ledger, run_copies
from resilient.secret import (
    QUARANTINE,
    RUN_DIR_SECRET,
    JobSecret,
    require_secret,
    resolve_secret,
)

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


def main(argv: list[str]) -> int:
    """``resilient quarantine list|clear``."""
    ap = argparse.ArgumentParser(prog="resilient quarantine", description="List or clear quarantined nodes "
                                 "(silent data corruption) and nodes marked slow (fail-slow's replace policy).")
    ap.add_argument("action", choices=("list", "clear"))
    ap.add_argument("node", nargs="?", help="the node to clear")
    ap.add_argument("--rdzv-endpoint", default=None, help="etcd HOST:PORT[,...] of the job (default with --run-dir: "
                    "the run's embedded etcd, RUN_DIR/control/etcd.json, while its agent runs)")
    ap.add_argument("--run-id", default=None, help="the job's run id (see the agent_start event; default with "
                    "--run-dir: the one launch derives from it)")
    ap.add_argument("--rdzv-conf", default="", help="etcd TLS/auth keys k=v,k=v, as for launch (ca_cert, cert, key, "
                    "username; the password from RESILIENT_ETCD_PASSWORD)")
    ap.add_argument("--secret-file", default=None, help="the job secret's file (default: $RESILIENT_JOB_SECRET_FILE, "
                    "$RESILIENT_JOB_SECRET, or RUN_DIR/job.secret with --run-dir)")
    ap.add_argument("--run-dir", default=None, help="the node's run dir: its copy of the records (RUN_DIR/ledger), "
                    "its job.secret, and on one machine its embedded etcd")
    ap.add_argument("--durable-url", default=None, help="the durable tier's URL, whose copy of the records every "
                    "node finds (default with --run-dir: the run's snapshot.durable_url, else RUN_DIR/checkpoints)")
    args = ap.parse_args(argv)
    from_run_dir = False   # the endpoint is the run dir's embedded etcd, owned by a live agent
    if args.run_dir:
        args.run_id = args.run_id or default_run_id(Path(args.run_dir))
    copies = run_copies(args.run_dir, args.durable_url if args.durable_url is not None else
                        durable_url_of(args.run_dir)) if args.run_dir or args.durable_url else []
    if not args.run_id or not (args.rdzv_endpoint or args.run_dir or copies):
        ap.error("give --run-dir of the node (its records, its job.secret), or --rdzv-endpoint and --run-id "
                 "(and --durable-url to reach the copies every node finds)")
    if args.action == "clear" and not args.node:
        ap.error("clear needs a NODE")
    check_name("--run-id", args.run_id)
    if args.node:
        check_name("NODE", args.node)
    secret = cli_secret(args)   # a clear is a newer record, sealed: it needs the secret too
    if args.run_dir and not args.rdzv_endpoint:
        from resilient.control.claim import read_owner

        owner = read_owner(args.run_dir, secret)   # the live agent that runs the run dir's etcd, if any
        if owner is not None:
            args.rdzv_endpoint, from_run_dir = owner.endpoint, True
        else:
            print(f"resilient quarantine: no agent of run dir {args.run_dir} is running its embedded etcd; using "
                  f"the copies in {', '.join(c.where for c in copies)}", file=sys.stderr)
    args.embedded = from_run_dir
    client = None
    if args.rdzv_endpoint:
        try:
            client = cli_client(args, secret)
        except EtcdAuthError:
            raise
        except EtcdError as e:
            if not from_run_dir:
                raise
            # its owner is going, with its etcd: the copies are what a relaunch reads
            print(f"resilient quarantine: etcd at {args.rdzv_endpoint} is not reachable ({e}); using the copies "
                  f"in {', '.join(c.where for c in copies)}", file=sys.stderr)
    with client if client is not None else contextlib.nullcontext():
        # both kinds of record a node can carry: quarantined for SDC (refused a start until
        # cleared) and marked slow by fail-slow's replace policy (its agent clears it itself
        # after healthy probes; an operator may clear it sooner). Slow marks live in etcd alone.
        books = [Quarantine(client, args.run_id, secret, copies=copies)] + (
            [SlowMarks(client, args.run_id, secret)] if client is not None else [])
        if args.action == "list":
            for book in books:
                good, forged = book.scan()
                for node, record in sorted(good.items()):
                    print(json.dumps({"kind": book.KIND, **record}))
                for node, why in sorted(forged.items()):
                    print(json.dumps({"kind": book.KIND, "node": node, "unauthentic": why, "ignored": True}))
            return 0
        cleared = [book for book in books if book.clear(args.node)]
        if not cleared:
            print(f"node {args.node!r} was neither quarantined nor marked slow in run {args.run_id!r}")
            return 1
        where = cleared[0].where
        print(f"cleared {args.node!r} ({' and '.join(b.KIND for b in cleared)}) in {', '.join(where)}; it may "
              f"rejoin run {args.run_id!r}")
        if where == ["etcd"]:
            print("resilient quarantine: the clear is kept in etcd alone, where whoever can write etcd could put the "
                  "old record back; pass --run-dir (on the node's machine) or --durable-url so that it is kept "
                  "where they cannot", file=sys.stderr)
        return 0


def durable_url_of(run_dir: str | os.PathLike | None) -> str:
    """The durable tier's URL of the run in ``run_dir`` (its ``runtime.json``, as launch wrote
    it); "" for the default (``RUN_DIR/checkpoints``) or when the file says nothing."""
    if run_dir is None:
        return ""
    try:
        doc = json.loads((Path(run_dir) / "runtime.json").read_text())
        url = doc.get("snapshot", {}).get("durable_url", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return url if isinstance(url, str) else ""


def cli_secret(args: argparse.Namespace) -> JobSecret:
    found = resolve_secret(args.secret_file)
    if found is None and args.run_dir:
        found = resolve_secret(Path(args.run_dir) / RUN_DIR_SECRET)
    return found if found is not None else require_secret(what="`resilient quarantine`")


def cli_client(args: argparse.Namespace, secret: JobSecret | None) -> EtcdClient:
    """An etcd client reaching the job's etcd as ``launch`` does (TLS, user and password), checked.

    ``args.embedded`` (the endpoint is a run dir's embedded etcd): with the client certificate and
    login derived from the job secret (:func:`resilient.etcd.server.embedded_etcd_conf`). Else,
    without a user in ``--rdzv-conf``, an etcd that demands a login or TLS is taken for the embedded
    etcd of ``resilient launch`` (no other etcd trusts that certificate or takes that password; a
    wrong or missing secret is a clear error)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from resilient.etcd.server import embedded_etcd_conf
    from resilient.rendezvous.registry import client_from_params, parse_rdzv_conf

    conf = {"retry_timeout": 5.0, **parse_rdzv_conf(args.rdzv_conf)}

    def connect(conf: dict) -> EtcdClient:
        client = client_from_params(RendezvousParameters(backend="etcd3", endpoint=args.rdzv_endpoint,
                                                         run_id=args.run_id, min_nodes=1, max_nodes=1, **conf))
        try:
            client.check()  # a wrong endpoint: a clear error in seconds, not the client's long retries
            client.count_prefix(f"/resilient/{args.run_id}/quarantine/")  # a login, if etcd wants one
        except BaseException:
            client.close()
            raise
        return client

    if conf.get("username") or conf.get("user"):
        return connect(conf)
    if not getattr(args, "embedded", False):
        try:
            return connect(conf)
        except EtcdUnavailable:
            raise
        except EtcdError:
            pass  # a login or a client certificate wanted: the embedded etcd, with the job secret's
    secret = secret if secret is not None else cli_secret(args)
    try:
        return connect({**conf, **embedded_etcd_conf(secret)})
    except EtcdAuthError as e:
        raise EtcdAuthError(
            f"etcd at {args.rdzv_endpoint} wants a login: if it is the embedded etcd of `resilient launch`, it "
            f"refused this job secret (fingerprint {secret.fingerprint}): pass the run's (--run-dir or "
            f"--secret-file); if it is an external etcd, pass --rdzv-conf username=... and "
            f"RESILIENT_ETCD_PASSWORD. ({e})") from None
