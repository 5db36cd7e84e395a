"""Quarantine of nodes whose hardware computed wrong answers.

When the SDC monitor confirms a persistent fault (the same wrong answer on
replay, or a failed arithmetic probe), the worker on that device exits with
:data:`QUARANTINE_EXIT`. Its agent records the node under
``/resilient/<run>/quarantine/<node>`` in etcd and leaves the job; the other
nodes re-form without it and roll back. An agent refuses to start on a
quarantined node until an operator, having checked or replaced the hardware,
clears the record::

    resilient quarantine list  --rdzv-endpoint HOST:PORT --run-id RUN
    resilient quarantine clear NODE --rdzv-endpoint HOST:PORT --run-id RUN

Records carry a MAC under the job secret (:mod:`resilient.secret`, bound to
the record's key). One that fails is reported (``auth_failure``) and ignored:
a forged record never quarantines a node, and a tampered one is no record. A
writer of etcd can still *delete* a record (that no MAC can prevent): the
embedded etcd of ``resilient launch`` lets only holders of the job secret in
(:mod:`resilient.etcd.server`); keep an external etcd authenticated on a shared
host (``--rdzv-conf username=...``). The CLI takes the job secret
(``--secret-file``, ``--run-dir`` or the environment) and the TLS/auth keys of
``--rdzv-conf``, as ``launch`` does; on a single-machine job ``--run-dir`` alone
finds the embedded etcd (``RUN_DIR/etcd.endpoint``), its run id and its secret,
and the CLI logs in to it with the secret.

A node the fail-slow checks found slow (``failslow.policy = "replace"``) takes
the same path, lighter: its workers exit with :data:`SLOW_EXIT`, its agent
records a mark under ``/resilient/<run>/slow/<node>`` (:class:`SlowMarks`, the
same sealed records), leaves the round so a spare takes the seat, and clears
the mark itself once a probe run shows the node healthy
(:mod:`resilient.failslow.replace`): no operator needed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from resilient.agent.api import AgentError
from resilient.etcd import EtcdAuthError, EtcdClient
from resilient.secret import (
    QUARANTINE,
    RUN_DIR_SECRET,
    JobSecret,
    Unauthentic,
    report_unauthentic,
    require_secret,
    resolve_secret,
)

QUARANTINE_EXIT = 75  # the worker's exit code for "my device is bad"
SLOW_EXIT = 78        # ... for "my node is slow: hand its seat over" (fail-slow replace; not a failure)


class NodeQuarantined(AgentError):
    """This node is quarantined; an operator must clear it first."""


PURPOSE = QUARANTINE


class Quarantine:
    """``secret``: the job secret (default: from the environment, :func:`resilient.secret.require_secret`)."""

    KIND = "quarantine"   # the records' directory under /resilient/<run>/

    def __init__(self, client: EtcdClient, run_id: str, secret: JobSecret | bytes | None = None, events: Any = None):
        self.client = client
        self.run_id = run_id
        self._secret = JobSecret.of(secret) if secret is not None else None
        self.events = events
        self.prefix = f"/resilient/{run_id}/{self.KIND}/"

    @property
    def secret(self) -> JobSecret:
        """Resolved when first needed: clearing a record (a delete) needs none."""
        if self._secret is None:
            self._secret = require_secret(what="the quarantine")
        return self._secret

    def add(self, node: str, **record) -> None:
        record = {"node": node, "time": time.time(), **record}
        self.client.put(self.prefix + node, self.secret.seal_record(PURPOSE, self.prefix + node, record))

    def get(self, node: str) -> dict | None:
        """The node's authentic record, or None (no record, or one that fails authentication)."""
        kv = self.client.get(self.prefix + node)
        if kv is None:
            return None
        try:
            return self.secret.open_record(PURPOSE, self.prefix + node, kv.value)
        except Unauthentic as e:
            report_unauthentic(self.events, "quarantine record", self.prefix + node, e)
            return None

    def scan(self) -> tuple[dict[str, dict], dict[str, str]]:
        """(node → authentic record, node → why its record fails authentication)."""
        good, forged = {}, {}
        for kv in self.client.get_prefix(self.prefix):
            key = kv.key.decode(errors="replace")
            try:
                good[key.removeprefix(self.prefix)] = self.secret.open_record(PURPOSE, key, kv.value)
            except Unauthentic as e:
                report_unauthentic(self.events, "quarantine record", key, e)
                forged[key.removeprefix(self.prefix)] = str(e)
        return good, forged

    def all(self) -> dict[str, dict]:
        return self.scan()[0]

    def clear(self, node: str) -> bool:
        return self.client.delete(self.prefix + node)

    def refuse_if_quarantined(self, node: str, endpoint: str) -> None:
        record = self.get(node)
        if record is not None:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["time"]))
            raise NodeQuarantined(
                f"node {node!r} is quarantined since {since} ({record.get('reason', 'silent data corruption')}, "
                f"device {record.get('device', '?')}); after checking or replacing its hardware, clear it with "
                f"`resilient quarantine clear {node} --rdzv-endpoint {endpoint} --run-id {self.run_id}`")


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
                    "the run's embedded etcd, RUN_DIR/etcd.endpoint)")
    ap.add_argument("--run-id", default=None, help="the job's run id (see the agent_start event; default with "
                    "--run-dir: the one launch derives from it)")
    ap.add_argument("--rdzv-conf", default="", help="etcd TLS/auth keys k=v,k=v, as for launch (ca_cert, cert, key, "
                    "username; the password from RESILIENT_ETCD_PASSWORD)")
    ap.add_argument("--secret-file", default=None, help="the job secret's file (default: $RESILIENT_JOB_SECRET_FILE, "
                    "$RESILIENT_JOB_SECRET, or RUN_DIR/job.secret with --run-dir)")
    ap.add_argument("--run-dir", default=None, help="the run dir of a single-machine job (holds its job.secret)")
    args = ap.parse_args(argv)
    if args.run_dir:
        from resilient.launch import default_run_id

        shared = Path(args.run_dir) / "etcd.endpoint"
        if not args.rdzv_endpoint and shared.exists():
            args.rdzv_endpoint = shared.read_text().strip()
        args.run_id = args.run_id or default_run_id(Path(args.run_dir))
    if not args.rdzv_endpoint or not args.run_id:
        ap.error("give --rdzv-endpoint and --run-id, or --run-dir of a single-machine job whose agents are running")
    secret = cli_secret(args) if args.action == "list" else None
    with cli_client(args, secret) as client:
        # both kinds of record a node can carry: quarantined for SDC (refused a start until
        # cleared) and marked slow by fail-slow's replace policy (its agent clears it itself
        # after healthy probes; an operator may clear it sooner)
        books = [Quarantine(client, args.run_id, secret), SlowMarks(client, args.run_id, secret)]
        if args.action == "list":
            for book in books:
                good, forged = book.scan()
                for node, record in sorted(good.items()):
                    print(json.dumps({"kind": book.KIND, **record}))
                for node, why in sorted(forged.items()):
                    print(json.dumps({"kind": book.KIND, "node": node, "unauthentic": why, "ignored": True}))
            return 0
        if not args.node:
            ap.error("clear needs a NODE")
        cleared = [book.KIND for book in books if book.clear(args.node)]
        if not cleared:
            print(f"node {args.node!r} was neither quarantined nor marked slow in run {args.run_id!r}")
            return 1
        print(f"cleared {args.node!r} ({' and '.join(cleared)}); it may rejoin run {args.run_id!r}")
        return 0


def cli_secret(args: argparse.Namespace) -> JobSecret:
    found = resolve_secret(args.secret_file)
    if found is None and args.run_dir:
        found = resolve_secret(Path(args.run_dir) / RUN_DIR_SECRET)
    return found if found is not None else require_secret(what="`resilient quarantine`")


def cli_client(args: argparse.Namespace, secret: JobSecret | None) -> EtcdClient:
    """An etcd client reaching the job's etcd as ``launch`` does (TLS, user and password), checked.

    Without a user in ``--rdzv-conf``, an etcd that demands a login is taken for the embedded etcd
    of ``resilient launch``: the client logs in as its root with the job secret's password (no other
    etcd takes that password; a wrong or missing secret is a clear error)."""
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
    try:
        return connect(conf)
    except EtcdAuthError:
        pass  # the embedded etcd: log in with the job secret
    secret = secret if secret is not None else cli_secret(args)
    try:
        return connect({**conf, **embedded_etcd_conf(secret)})
    except EtcdAuthError as e:
        raise EtcdAuthError(
            f"etcd at {args.rdzv_endpoint} wants a login: if it is the embedded etcd of `resilient launch`, it "
            f"refused this job secret (fingerprint {secret.fingerprint}): pass the run's (--run-dir or "
            f"--secret-file); if it is an external etcd, pass --rdzv-conf username=... and "
            f"RESILIENT_ETCD_PASSWORD. ({e})") from None
