"""A node id belongs to one live agent of a run (NodeRegistry.claim), against a real etcd.

Why: a second agent started with a live node's --node-id used to overwrite that
node's key under its own lease and delete it on exit, after which a node with
another config passed the job check."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from datetime import timedelta

import pytest

from resilient.agent.api import NodeIdInUse
from resilient.agent.membership import PURPOSE, NodeRegistry
from resilient_chaos.etcd_testing import unique_run_id

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]
TTL = timedelta(seconds=2)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_keeps_its_node_id(etcd, job_secret):
    run_id = unique_run_id("claim")
    with etcd.client() as client:
        a = NodeRegistry(client, run_id, "n0", "r0", TTL)
        a.claim(job="A")
        b = NodeRegistry(client, run_id, "n0", "r1", TTL)
        with pytest.raises(NodeIdInUse, match="'n0' is in use.*another --node-id"):
            b.claim(wait=timedelta(seconds=0.5), job="B")
        b.leave()
        # the holder's key is untouched: its description, under its own lease
        assert json.loads(client.get(a.prefix + "n0").value)["job"] == "A"
        assert set(a.alive()) == {"n0"}
        a.leave()


def test_a_dead_agent_of_this_host_is_taken_over_at_once(etcd, job_secret):
    run_id = unique_run_id("claim")
    with etcd.client() as client:
        key = f"/resilient/{run_id}/nodes/n0"
        stale = {"node": "n0", "host": socket.gethostname(), "pid": _dead_pid(), "job": "old"}
        lease = client.lease(timedelta(seconds=60), keep_alive=False)
        client.put(key, job_secret.seal_record(PURPOSE, key, stale), lease=lease)
        me = NodeRegistry(client, run_id, "n0", "r0", TTL)
        me.claim(job="new")
        assert lease.remaining() is not None  # taken over while the stale lease still lives: not waited out
        assert json.loads(client.get(me.prefix + "n0").value)["job"] == "new"
        me.leave()
        assert client.get(me.prefix + "n0") is None  # now held by our lease: gone with it


def test_a_silent_holder_elsewhere_is_waited_out(etcd, job_secret):
    """Another host's key: its pid cannot be checked, so its lease must lapse first."""
    run_id = unique_run_id("claim")
    with etcd.client() as client:
        key = f"/resilient/{run_id}/nodes/n0"
        other = {"node": "n0", "host": "elsewhere", "pid": 1, "job": "old"}
        lease = client.lease(timedelta(seconds=1), keep_alive=False)
        client.put(key, job_secret.seal_record(PURPOSE, key, other), lease=lease)
        me = NodeRegistry(client, run_id, "n0", "r0", TTL)
        me.claim(job="new")
        assert lease.remaining() is None  # the holder's lease lapsed before the claim succeeded
        assert json.loads(client.get(me.prefix + "n0").value)["job"] == "new"
        me.leave()


def test_forged_entries_never_hold_an_id_nor_count_as_live(etcd, job_secret):
    """Entries written without the job secret (plain JSON, a copy moved from another key, another
    job's MAC): a forged holder of our id is overwritten at once, and no forged entry is alive."""
    from resilient.secret import JobSecret

    run_id = unique_run_id("claim")
    prefix = f"/resilient/{run_id}/nodes/"
    with etcd.client() as client:
        lease = client.lease(timedelta(seconds=60), keep_alive=False)
        live_elsewhere = {"node": "n0", "host": "elsewhere", "pid": 1, "store": "10.0.0.66:1"}
        client.put(prefix + "n0", json.dumps(live_elsewhere), lease=lease)
        client.put(prefix + "n1", job_secret.seal_record(PURPOSE, prefix + "n9", {**live_elsewhere, "node": "n1"}))
        other_job = JobSecret(b"o" * 32)
        client.put(prefix + "n2", other_job.seal_record(PURPOSE, prefix + "n2", {**live_elsewhere, "node": "n2"}))
        me = NodeRegistry(client, run_id, "n0", "r0", TTL)
        me.claim(job="new")
        assert lease.remaining() is not None  # not waited out: a forged entry holds nothing
        assert json.loads(client.get(prefix + "n0").value)["job"] == "new"
        assert set(me.alive()) == {"n0"}
        assert me.proven_dead(["n1", "n2"]) == set()
        me.leave()


def test_an_agent_with_another_secret_is_told_at_once_by_fingerprint(etcd, job_secret):
    """Two agents of one run with different secrets: the second's claim raises SecretMismatch
    naming both fingerprints (not a stream of auth_failures until a rendezvous times out), and
    its claim is withdrawn; agents with the same secret pass."""
    from resilient.secret import JobSecret, JobSecretError, SecretMismatch

    run_id = unique_run_id("claim")
    ours, other = JobSecret(b"o" * 32), JobSecret(b"t" * 32)
    with etcd.client() as client:
        a = NodeRegistry(client, run_id, "n0", "r0", TTL, secret=ours)
        a.claim(job="A")
        same = NodeRegistry(client, run_id, "n1", "r1", TTL, secret=ours)
        same.claim(job="A")
        b = NodeRegistry(client, run_id, "n2", "r2", TTL, secret=other)
        with pytest.raises(SecretMismatch) as e:
            b.claim(job="A")
        assert isinstance(e.value, JobSecretError)
        assert ours.fingerprint in str(e.value) and other.fingerprint in str(e.value) and "same secret" in str(e.value)
        assert client.get(b.prefix + "n2") is None   # withdrawn: the node id is free again
        assert set(a.alive()) == {"n0", "n1"}
        a.leave()
        same.leave()
