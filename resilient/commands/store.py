"""``resilient store ls|drop``: the node-store trees this user's agents left in RAM on this
machine (what they are and how long they are kept: :mod:`resilient.snapshot.storeroot`)."""

from __future__ import annotations

import argparse

from resilient.snapshot.storeroot import drop, node_trees, user_root


def main(argv: list[str]) -> int:
    """``resilient store ls|drop``: the node-store trees this user's agents left on this machine."""
    ap = argparse.ArgumentParser(prog="resilient store", description="Node-store trees in RAM (tmpfs) on this "
                                 "machine: those kept by agents that died or stopped with their run unfinished "
                                 "(a relaunch of the same run restores from them), and live ones.")
    ap.add_argument("--store-dir", default="/dev/shm", help="snapshot.store_dir of the runs (default /dev/shm)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list the trees: run, node, live/kept/dead, size, idle time")
    d = sub.add_parser("drop", help="remove kept trees (never a live agent's)")
    d.add_argument("run_id", nargs="?", help="only this run's trees (default: every tree whose agent is gone)")
    d.add_argument("--node", help="only this node's tree")
    args = ap.parse_args(argv)
    trees = node_trees(args.store_dir, sizes=True)
    if args.cmd == "ls":
        if not trees:
            print(f"no node stores under {user_root(args.store_dir)}")
        for t in trees:
            state = "live" if t.alive else ("kept" if t.kept else "dead")
            print(f"{t.run_id:<24} {t.node:<16} {state:<5} {t.nbytes / 2**20:10.1f} MiB  idle {t.idle_s / 3600:6.1f} h")
        return 0
    gone = [t for t in trees if not t.alive and (args.run_id is None or t.run_id == args.run_id)
            and (args.node is None or t.node == args.node)]
    for t in gone:
        drop(t)
        print(f"dropped {t.run_id}/{t.node} ({t.nbytes / 2**20:.1f} MiB)")
    if not gone:
        print("nothing to drop (trees of live agents are never dropped)")
    return 0
