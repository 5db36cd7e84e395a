"""A node id belongs to one live agent of a run (NodeRegistry.claim), against a real etcd.

Why: a second agent started with a live node's --node-id used to overwrite that
node's key under its own lease and delete it on exit, after which a node with
another config passed the job check."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from resilient.agent.api import NodeIdInUse
from resilient.agent.membership import NodeRegistry
from resilient.etcd.testing import unique_run_id

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]
TTL = timedelta(seconds=2)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_keeps_its_node_id(etcd):
    run_id = unique_run_id("claim")
    with etcd.client() as client:
        a = NodeRegistry(client, run_id, "n0", "r0", TTL)
        a.claim(job="A")
        b = NodeRegistry(client, run_id, "n0", "r1", TTL)
        t0 = time.monotonic()
        with pytest.raises(NodeIdInUse, match="'n0' is in use.*another --node-id"):
            b.claim(wait=timedelta(seconds=0.5), job="B")
        assert time.monotonic() - t0 < 5
        b.leave()
        # the holder's key is untouched: its description, under its own lease
        assert json.loads(client.get(a.prefix + "n0").value)["job"] == "A"
        assert set(a.alive()) == {"n0"}
        a.leave()


def test_a_dead_agent_of_this_host_is_taken_over_at_once(etcd):
    run_id = unique_run_id("claim")
    with etcd.client() as client:
        stale = {"node": "n0", "host": socket.gethostname(), "pid": _dead_pid(), "job": "old"}
        lease = client.lease(timedelta(seconds=60), keep_alive=False)
        client.put(f"/resilient/{run_id}/nodes/n0", json.dumps(stale), lease=lease)
        me = NodeRegistry(client, run_id, "n0", "r0", TTL)
        t0 = time.monotonic()
        me.claim(job="new")
        assert time.monotonic() - t0 < 1.5  # not the stale lease's 60 s, nor our ttl
        assert json.loads(client.get(me.prefix + "n0").value)["job"] == "new"
        me.leave()
        assert client.get(me.prefix + "n0") is None  # now held by our lease: gone with it


def test_a_silent_holder_elsewhere_is_waited_out(etcd):
    """Another host's key: its pid cannot be checked, so its lease must lapse first."""
    run_id = unique_run_id("claim")
    with etcd.client() as client:
        other = {"node": "n0", "host": "elsewhere", "pid": 1, "job": "old"}
        lease = client.lease(timedelta(seconds=1), keep_alive=False)
        client.put(f"/resilient/{run_id}/nodes/n0", json.dumps(other), lease=lease)
        me = NodeRegistry(client, run_id, "n0", "r0", TTL)
        me.claim(job="new")
        assert json.loads(client.get(me.prefix + "n0").value)["job"] == "new"
        me.leave()
