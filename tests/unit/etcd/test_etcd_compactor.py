"""etcd history compaction by the agents: a job that writes every step must not fill
etcd's quota. Against a real etcd: history older than one interval is compacted, the
current values stay, and a second compactor doing the same is harmless."""

from __future__ import annotations

import base64
import time
from datetime import timedelta

import pytest

from resilient.gpt.config import ConfigError, load_config
from resilient.etcd.client import EtcdClient
from resilient.etcd.compactor import HistoryCompactor


def _read_at(client: EtcdClient, key: str, revision: int) -> dict:
    """A range read at an old revision, straight through the gateway."""
    return client._post("/kv/range", {"key": base64.b64encode(key.encode()).decode(), "revision": revision}, "read")


def test_history_before_the_previous_round_is_compacted_and_values_stay(etcd):
    with EtcdClient(etcd.endpoint) as client:
        first = client.put("/resilient/test-compact/k", "v0")
        for i in range(1, 20):
            client.put("/resilient/test-compact/k", f"v{i}")
        assert _read_at(client, "/resilient/test-compact/k", first)["kvs"]  # history is there
        comp = HistoryCompactor(client, timedelta(minutes=5), start=False)  # the rounds by hand
        comp.tick()                       # notes the current revision, compacts nothing yet
        assert comp.compacted is None
        seen = comp._seen
        client.put("/resilient/test-compact/k", "last")
        comp.tick()                       # compacts up to what the first round saw
        assert comp.compacted == seen
        with pytest.raises(Exception, match="compacted"):
            _read_at(client, "/resilient/test-compact/k", first)
        assert client.get("/resilient/test-compact/k").value == b"last"
        assert client.compact(seen) is False  # again (another agent): refused, not an error


def test_the_thread_compacts_every_interval(etcd):
    with EtcdClient(etcd.endpoint) as client:
        first = client.put("/resilient/test-compact/t", "a")
        client.put("/resilient/test-compact/t", "b")
        comp = HistoryCompactor(client, timedelta(milliseconds=100))
        try:
            deadline = time.monotonic() + 10
            while comp.compacted is None and time.monotonic() < deadline:
                time.sleep(0.05)
                client.put("/resilient/test-compact/t", "c")
            assert comp.compacted is not None and comp.compacted > first
        finally:
            comp.close()
        assert client.get("/resilient/test-compact/t").value == b"c"


def test_the_interval_knob(tmp_path):
    assert load_config(None, ["launch.etcd_compact_interval=0"]).launch.etcd_compact_interval == 0
    with pytest.raises(ConfigError, match="etcd_compact_interval"):
        load_config(None, ["launch.etcd_compact_interval=-1"]).validate_layout(1)  # as launch checks it
    with pytest.raises(ValueError):
        HistoryCompactor(None, timedelta(0))


def test_a_full_etcd_is_a_typed_error_and_compaction_keeps_it_from_filling():
    from resilient.etcd.api import EtcdFull
    from resilient_chaos.etcd_testing import embedded_etcd

    # Rounds of 150 KB against an 8 MB quota: compacted, the history kept (up to two rounds)
    # is far below it, whatever etcd's lag in reusing freed pages on a loaded host.
    value = "x" * 30_000
    with embedded_etcd(extra_args=[f"--quota-backend-bytes={8 << 20}"]) as server, \
            EtcdClient(server.endpoint) as client:
        comp = HistoryCompactor(client, timedelta(minutes=5), start=False)  # rounds by hand
        for i in range(500):  # 15 MB of writes into an 8 MB quota: fine while compacted
            client.put(f"/resilient/test-full/k{i % 4}", value)
            if i % 5 == 4:
                comp.tick()
        with pytest.raises(EtcdFull, match="etcdctl defrag"):
            for i in range(500):  # the same writes, not compacted: the quota fills
                client.put(f"/resilient/test-full/k{i % 4}", value)


def test_a_new_cluster_with_fewer_revisions_starts_the_count_over(etcd):
    from resilient_chaos.etcd_testing import embedded_etcd

    with EtcdClient(etcd.endpoint) as old:
        for i in range(30):
            old.put("/resilient/test-compact/n", str(i))
        comp = HistoryCompactor(old, timedelta(minutes=5), start=False)
        comp.tick()
        comp.tick()
    with embedded_etcd() as fresh, EtcdClient(fresh.endpoint) as client:  # etcd lost its data
        comp.client = client
        comp.tick()  # the revision went backwards: no compaction to a future revision
        assert comp.compacted is None and comp._seen == client.revision()
        client.put("/resilient/test-compact/n", "x")
        comp.tick()
        assert comp.compacted is not None


def test_failing_rounds_warn_once_and_the_thread_goes_on(caplog):
    from resilient.etcd.server import free_port

    client = EtcdClient(f"127.0.0.1:{free_port()}", retry_timeout=timedelta(milliseconds=50))  # nothing listens
    caplog.set_level("DEBUG", logger="resilient.etcd.compactor")
    comp = HistoryCompactor(client, timedelta(milliseconds=50))
    try:
        deadline = time.monotonic() + 10
        while len([r for r in caplog.records if "skipped" in r.getMessage()]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert comp._thread.is_alive()
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "could not compact" in warnings[0].getMessage()
    finally:
        comp.close()
        client.close()
