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
"""

from __future__ import annotations

import argparse
import json
import time

from resilient.agent.api import AgentError
from resilient.etcd import EtcdClient

QUARANTINE_EXIT = 75  # the worker's exit code for "my device is bad"


class NodeQuarantined(AgentError):
    """This node is quarantined; an operator must clear it first."""


class Quarantine:
    def __init__(self, client: EtcdClient, run_id: str):
        self.client = client
        self.run_id = run_id
        self.prefix = f"/resilient/{run_id}/quarantine/"

    def add(self, node: str, **record) -> None:
        record = {"node": node, "time": time.time(), **record}
        self.client.put(self.prefix + node, json.dumps(record))

    def get(self, node: str) -> dict | None:
        kv = self.client.get(self.prefix + node)
        return json.loads(kv.value) if kv is not None else None

    def all(self) -> dict[str, dict]:
        return {kv.key.decode().removeprefix(self.prefix): json.loads(kv.value)
                for kv in self.client.get_prefix(self.prefix)}

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


def main(argv: list[str]) -> int:
    """``resilient quarantine list|clear``."""
    ap = argparse.ArgumentParser(prog="resilient quarantine", description="List or clear quarantined nodes.")
    ap.add_argument("action", choices=("list", "clear"))
    ap.add_argument("node", nargs="?", help="the node to clear")
    ap.add_argument("--rdzv-endpoint", required=True, help="etcd HOST:PORT[,...] of the job")
    ap.add_argument("--run-id", required=True, help="the job's run id (see the agent_start event)")
    args = ap.parse_args(argv)
    with EtcdClient(args.rdzv_endpoint) as client:
        client.check()  # a wrong endpoint: a clear error in seconds, not the client's long retries
        q = Quarantine(client, args.run_id)
        if args.action == "list":
            for node, record in sorted(q.all().items()):
                print(json.dumps(record))
            return 0
        if not args.node:
            ap.error("clear needs a NODE")
        if not q.clear(args.node):
            print(f"node {args.node!r} was not quarantined in run {args.run_id!r}")
            return 1
        print(f"cleared {args.node!r}; it may rejoin run {args.run_id!r}")
        return 0
