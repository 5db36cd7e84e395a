"""Network namespaces + iptables: traffic flows before a fault, not during,
and again after. Skipped, with the reason, where namespaces are not allowed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from resilient_chaos.netns import LinkCut, NetLab, PacketLoss, Partition, netns_unavailable

REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unusable: {REASON}")

PORT = 7000  # inside a fresh namespace every port is free
SERVER = f"""
import socket, threading
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(("0.0.0.0", {PORT})); t.listen(16)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", {PORT}))
def udp():
    while True:
        data, addr = u.recvfrom(2048); u.sendto(data, addr)
threading.Thread(target=udp, daemon=True).start()
print("ready", flush=True)
while True:
    c, _ = t.accept(); c.close()
"""
CLIENT = "import socket, sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()"


@pytest.fixture
def lab():
    lab = NetLab(3)
    procs: list[subprocess.Popen] = []
    lab.create()
    try:
        for i in range(3):
            p = subprocess.Popen(lab.exec_prefix(i) + [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "ready"
        yield lab
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        lab.destroy()
        assert lab.leftovers() == []


def tcp_ok(addr: str, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((addr, PORT), timeout=timeout).close()
        return True
    except OSError:
        return False


def tcp_ok_from(lab: NetLab, node: int, addr: str, timeout: float = 1.0) -> bool:
    p = subprocess.run(lab.exec_prefix(node) + [sys.executable, "-c", CLIENT, addr, str(PORT), str(timeout)], capture_output=True, timeout=30)
    return p.returncode == 0


def udp_replies(addr: str, n: int = 60) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.5)
        for i in range(n):
            s.sendto(str(i).encode(), (addr, PORT))
            time.sleep(0.002)
        got = set()
        try:
            while len(got) < n:
                got.add(s.recv(64))
        except socket.timeout:
            pass
        return len(got)


def test_partition_cuts_a_node_off_and_heals(lab):
    b = lab.addresses[1]
    assert tcp_ok(b) and tcp_ok_from(lab, 0, b)
    with Partition(lab, 1, target="node:1") as inj:
        assert inj.record.status == "injected"
        assert not tcp_ok(b)
        assert not tcp_ok_from(lab, 0, b)
        assert tcp_ok(lab.addresses[2])  # the others are untouched
    assert tcp_ok(b) and tcp_ok_from(lab, 0, b)
    assert "rchaos" not in lab.iptables(1, "-S").stdout


def test_link_cut_is_selective(lab):
    a, b = lab.addresses[0], lab.addresses[1]
    assert tcp_ok_from(lab, 0, b)
    with LinkCut(lab, 0, peer=1, target="link:0-1"):
        assert not tcp_ok_from(lab, 0, b)
        assert not tcp_ok_from(lab, 1, a)
        assert tcp_ok(b) and tcp_ok(a)  # both still reach the host (etcd)
        assert tcp_ok_from(lab, 0, lab.addresses[2])
    assert tcp_ok_from(lab, 0, b)


def test_packet_loss_drops_some_packets(lab):
    c = lab.addresses[2]
    assert udp_replies(c) == 60
    with PacketLoss(lab, 2, probability=0.5, target="node:2"):
        got = udp_replies(c)
    # P(none of 60 datagrams dropped at 50%) = 2**-60: a lower bound only.
    assert got < 60
    assert udp_replies(c) == 60


def test_fault_on_uncreated_lab_is_skipped_with_reason():
    rec = Partition(NetLab(1), 0).inject()
    assert rec.status == "skipped" and "not created" in rec.detail
