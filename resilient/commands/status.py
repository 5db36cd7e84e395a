"""``resilient status``: the command (its options, where it reads etcd from, the refresh
loop); what it shows is :mod:`resilient.observe.status`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from resilient.errors import ConfigError
from resilient.observe.status import RunLog, collect, from_etcd, merge_etcd, render


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="resilient status", description="A live view of a job: members, round, "
                                 "worker state, commits, failures, recoveries, quarantine, goodput.")
    ap.add_argument("run_dir", nargs="?", help="the job's run dir (its events.jsonl files)")
    ap.add_argument("--rdzv-endpoint", default=None, help="etcd HOST:PORT[,...] of the job: read its live records")
    ap.add_argument("--run-id", default=None, help="the job's run id (with --rdzv-endpoint; default: the "
                    "agent_start event's, with a run dir)")
    ap.add_argument("--rdzv-conf", default="", help="etcd TLS/auth keys k=v,k=v, as for launch")
    ap.add_argument("--secret-file", default=None, help="the job secret's file (default: $RESILIENT_JOB_SECRET_FILE, "
                    "$RESILIENT_JOB_SECRET, or RUN_DIR/job.secret)")
    ap.add_argument("--once", action="store_true", help="print once and exit (for scripts)")
    ap.add_argument("--json", action="store_true", help="JSON instead of text (one object per refresh)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    args = ap.parse_args(argv)
    if not args.run_dir and not args.rdzv_endpoint:
        ap.error("give a RUN_DIR, or --rdzv-endpoint HOST:PORT --run-id ID")
    if args.run_dir and not Path(args.run_dir).is_dir():
        raise ConfigError(f"run dir {args.run_dir} does not exist; pass the --run-dir the job was launched with")
    if not args.interval > 0:
        raise ConfigError(f"--interval {args.interval}: give a positive number of seconds, e.g. --interval 2")
    return args


def _etcd_target(args: argparse.Namespace, st: dict) -> tuple[str, str] | None:
    """Where to read etcd from: the options, else a running single-machine job's embedded etcd:
    its owner's, then the other members' of a cluster (launch.etcd_members = 3), which still
    answer once the owner is lost."""
    run_id = args.run_id or st.get("run_id")
    if args.rdzv_endpoint:
        if not run_id:
            raise ConfigError("--rdzv-endpoint needs --run-id (the agent_start event of the job names it)")
        return args.rdzv_endpoint, run_id
    if not run_id or st.get("state") != "running":
        return None
    from resilient.control.reach import cli_secret
    from resilient.control.claim import peek_owner
    from resilient.control.plane import cluster_endpoints
    from resilient.secret import JobSecretError

    # The owner record is not authenticated here: the client's TLS is (only a holder of the job
    # secret serves a certificate under the CA derived from it), and every record read is (MACs).
    owner = peek_owner(args.run_dir)
    endpoints = [owner.endpoint] if owner is not None else []
    try:
        members = cluster_endpoints(args.run_dir, cli_secret(args))
    except JobSecretError:
        members = []   # from_etcd says what is missing, when there is an owner to ask
    endpoints += [e for e in members if e not in endpoints]
    return (",".join(endpoints), run_id) if endpoints else None


def main(argv: list[str]) -> int:
    args = _parse(argv)
    tail = RunLog(args.run_dir) if args.run_dir else None
    if tail is not None and not tail.paths():
        raise ConfigError(f"{args.run_dir} holds no events.jsonl: not a run dir, or its job never started")
    try:
        while True:
            st = collect(tail)
            target = _etcd_target(args, st)
            etcd = None
            if target is not None:
                etcd = from_etcd(*target, rdzv_conf=args.rdzv_conf, secret_file=args.secret_file, run_dir=args.run_dir,
                                 embedded=not args.rdzv_endpoint)
                if tail is not None:
                    st = collect(tail)  # again: the events then are at least as new as etcd's records
            st = merge_etcd(st, etcd)
            if args.json:
                print(json.dumps(st, default=str), flush=True)
            else:
                if not args.once and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")  # home + clear, like top
                print(render(st), flush=True)
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
