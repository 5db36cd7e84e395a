"""``resilient quarantine list|clear``: the nodes quarantined for silent data corruption and
those fail-slow's ``replace`` policy marked slow, listed or cleared by an operator (the records
themselves: :mod:`resilient.agent.quarantine`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from resilient.agent.quarantine import Quarantine, SlowMarks
from resilient.contract import check_name, default_run_id
from resilient.control.reach import cli_client, cli_secret, durable_url_of
from resilient.etcd import EtcdAuthError, EtcdError
from resilient.ledger import run_copies


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
