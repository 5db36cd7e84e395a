"""The control-plane chaos kinds of issue 28.

``embedded-etcd-kill`` against real etcd: a kill -9 of a watched member from outside is undone
by its watch (same ports, same data), and the injector says so; an unwatched member stays dead
and the injection fails, by name. A deliberate stop through the server object (the etcd-loss
kind) is not undone by the watch.

``store-full`` on a real small tmpfs (root): the node stores' filesystem is full until the
fault clears; the harness mounts it as ``snapshot.store_dir`` when a scenario has the kind."""

from __future__ import annotations

from datetime import timedelta

import pytest

from resilient_chaos.etcd_testing import embedded_etcd
from resilient_chaos.disk import FillStore, mount_unavailable
from resilient_chaos.infra import Infra
from resilient_chaos.injectors import EtcdMemberKill, InjectionFailed
from resilient_chaos.scenario import scenario_from_dict

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def test_a_killed_watched_member_serves_again_with_its_data():
    with embedded_etcd() as etcd:
        etcd.watch(interval=timedelta(seconds=0.1))
        with etcd.client() as c:
            c.put("/chaos/kept", "1")
        old, port = etcd.pid, etcd.client_port
        rec = EtcdMemberKill(etcd, target="etcd:0", fault_id="f1").inject()
        assert rec.status == "injected" and "its watch restarted it" in rec.detail, rec
        assert etcd.pid != old and etcd.client_port == port
        with etcd.client() as c:
            assert c.get("/chaos/kept").value == b"1"
        # A stop on purpose is left alone by the watch until start().
        etcd.stop()
        with pytest.raises(InjectionFailed):
            EtcdMemberKill(etcd, settle=timedelta(seconds=1))._inject()
        assert not etcd.running()
        etcd.start()


def test_an_unwatched_member_is_not_restarted_and_the_injection_fails():
    with embedded_etcd() as etcd:
        with pytest.raises(InjectionFailed, match="not serving again"):
            EtcdMemberKill(etcd, settle=timedelta(seconds=1))._inject()


def test_a_scenario_may_name_the_kind_and_a_bare_etcd_target_picks_a_member():
    sc = scenario_from_dict({"name": "k", "topology": {"nodes": 2, "etcd_members": 3},
                             "faults": [{"kind": "embedded-etcd-kill", "target": "etcd", "at_step": 5}]})
    (f,) = sc.plan()
    assert f.kind == "embedded-etcd-kill" and f.target.index in (0, 1, 2)


@pytest.mark.skipif(mount_unavailable() is not None, reason=str(mount_unavailable()))
def test_store_full_fills_the_node_stores_volume_until_cleared(tmp_path):
    sc = scenario_from_dict({"name": "s", "topology": {"nodes": 2},
                             "faults": [{"kind": "store-full", "target": "local", "at_step": 5}]})
    with Infra(sc, tmp_path / "run") as infra:
        store = infra.store_path
        assert f'snapshot.store_dir="{store}"' in infra.launch_overrides()
        fault = FillStore(store, target="local", fault_id="f1")
        assert fault.inject().status == "injected"
        with pytest.raises(OSError):
            (store / "probe").write_bytes(b"x" * 65536)
        fault.clear()
        (store / "probe").write_bytes(b"x" * 65536)
    assert not store.exists()


def test_store_full_refuses_a_filesystem_bigger_than_its_bound(tmp_path):
    with pytest.raises(InjectionFailed, match="SmallVolume"):
        FillStore(tmp_path, target="local", fault_id="f2", max_bytes=1 << 20).inject()
