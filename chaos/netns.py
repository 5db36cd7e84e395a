"""Network faults with network namespaces, veth pairs and iptables.

:class:`NetLab` builds a small cluster network on one host: a bridge in the
root namespace (which keeps etcd and the harness reachable at
``host_address``) and one namespace per node, each joined to the bridge by a
veth pair. Agents are started inside their node's namespace with
``lab.exec_prefix(i) + ["resilient", "launch", ...]``.

Faults are iptables rules *inside a node's namespace* (:class:`Partition`,
:class:`LinkCut`, :class:`PacketLoss`), so they never touch the host's
firewall, and deleting the namespace removes them whatever happened.
Without root or without ``ip``/``iptables`` the injectors report
"skipped: reason" (see :func:`netns_unavailable`), never a silent pass.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import uuid
from datetime import timedelta
from typing import Any

from .injectors import InjectionFailed, Injector

CMD_TIMEOUT = timedelta(seconds=10)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT.total_seconds())
    if check and p.returncode:
        raise InjectionFailed(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def netns_unavailable() -> str | None:
    """Why namespaces + iptables cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces and iptables need root (euid is not 0)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (Debian: apt-get install iproute2 iptables)"
    probe = f"rcprobe{uuid.uuid4().hex[:6]}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT.total_seconds())
    if p.returncode:
        return f"'ip netns add' is not permitted: {p.stderr.strip()}"
    try:
        q = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-S"], capture_output=True, text=True, timeout=CMD_TIMEOUT.total_seconds())
        if q.returncode:
            return f"iptables does not work in a namespace: {q.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT.total_seconds())
    return None


class NetLab:
    """N node namespaces on a bridge; ``create()`` / ``destroy()`` (or
    ``with``). Names carry a random tag so concurrent labs do not collide,
    and stay under the kernel's 15-character interface-name limit."""

    def __init__(self, nodes: int, subnet: str = "") -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.nodes = nodes
        # A random /24 in 10.200-254.x.0 keeps concurrent labs apart.
        if not subnet:
            n = int(self.tag, 16)
            subnet = f"10.{200 + n % 55}.{(n >> 8) % 256}.0/24"
        self.net = ipaddress.ip_network(subnet)
        hosts = list(self.net.hosts())
        if nodes + 1 > len(hosts):
            raise ValueError(f"subnet {subnet} too small for {nodes} nodes")
        self.host_address = str(hosts[0])
        self.addresses = [str(hosts[i + 1]) for i in range(nodes)]
        self.bridge = f"rcbr{self.tag}"
        self.namespaces = [f"rcns{self.tag}n{i}" for i in range(nodes)]
        self.created = False

    def _veth(self, i: int) -> tuple[str, str]:
        return f"rcv{self.tag}h{i}", f"rcv{self.tag}n{i}"

    def create(self) -> "NetLab":
        reason = netns_unavailable()
        if reason:
            raise InjectionFailed(f"cannot build the network lab: {reason}")
        self.created = True
        try:
            plen = self.net.prefixlen
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.host_address}/{plen}", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i, ns in enumerate(self.namespaces):
                host_end, ns_end = self._veth(i)
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end])
                _run(["ip", "link", "set", ns_end, "netns", ns])
                _run(["ip", "link", "set", host_end, "master", self.bridge])
                _run(["ip", "link", "set", host_end, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/{plen}", "dev", ns_end])
                _run(["ip", "-n", ns, "link", "set", ns_end, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.destroy()
            raise
        return self

    def interface(self, node: int) -> str:
        """Node ``node``'s network interface inside its namespace."""
        return self._veth(node)[1]

    def exec_prefix(self, node: int) -> list[str]:
        """Prefix a command with this to run it inside node ``node``."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def iptables(self, node: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(self.exec_prefix(node) + ["iptables", "-w", *args], check=check)

    def destroy(self) -> None:
        """Remove namespaces (their veth ends and iptables rules go with
        them) and the bridge. Safe to call twice or after a failed create."""
        for i, ns in enumerate(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=CMD_TIMEOUT.total_seconds())
            subprocess.run(["ip", "link", "del", self._veth(i)[0]], capture_output=True, timeout=CMD_TIMEOUT.total_seconds())
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=CMD_TIMEOUT.total_seconds())
        self.created = False

    def leftovers(self) -> list[str]:
        """Namespaces or links of this lab that still exist (for leak checks)."""
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [n for n in self.namespaces if n in ns] + ([self.bridge] if self.bridge in links else [])

    def __enter__(self) -> "NetLab":
        return self.create()

    def __exit__(self, *exc: Any) -> None:
        self.destroy()


class _RulesFault(Injector):
    """Adds iptables rules in one node's namespace, deletes them on clear.

    Each rule carries a comment with the fault id so they can be listed, and
    the injection is verified by reading the rules back (``iptables -S``).
    """

    def __init__(self, lab: NetLab, node: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.lab, self.node = lab, node
        self.rules: list[list[str]] = []

    def preflight(self) -> str | None:
        if os.geteuid() != 0 or shutil.which("iptables") is None:
            return netns_unavailable() or "iptables unavailable"
        if not self.lab.created:
            return "the network lab was not created (topology.network = 'netns' needed)"
        return None

    def _build(self) -> list[list[str]]:
        raise NotImplementedError

    def _inject(self) -> str:
        tag = ["-m", "comment", "--comment", f"rchaos-{self.fault_id}"]
        self.rules = [[r[0], *tag, *r[1:]] for r in self._build()]
        added = []
        try:
            for rule in self.rules:
                self.lab.iptables(self.node, "-I", *rule)
                added.append(rule)
        except InjectionFailed:
            for rule in added:
                self.lab.iptables(self.node, "-D", *rule, check=False)
            raise
        listing = self.lab.iptables(self.node, "-S").stdout
        n = listing.count(f"rchaos-{self.fault_id}")
        if n != len(self.rules):
            raise InjectionFailed(f"{n} of {len(self.rules)} rules visible in {self.lab.namespaces[self.node]}")
        return f"{len(self.rules)} iptables rule(s) in {self.lab.namespaces[self.node]}"

    def _clear(self) -> None:
        for rule in self.rules:
            self.lab.iptables(self.node, "-D", *rule, check=False)


class Partition(_RulesFault):
    """Cut node ``node`` off from every other address (loopback stays up)."""

    kind = "partition"

    def _build(self) -> list[list[str]]:
        return [["INPUT", "!", "-i", "lo", "-j", "DROP"], ["OUTPUT", "!", "-o", "lo", "-j", "DROP"]]


class LinkCut(_RulesFault):
    """Cut the link between node ``node`` and node ``peer`` only; both keep
    reaching everything else (etcd, the other nodes)."""

    kind = "link-cut"

    def __init__(self, lab: NetLab, node: int, peer: int, **kw: Any) -> None:
        super().__init__(lab, node, **kw)
        self.peer = peer

    def _build(self) -> list[list[str]]:
        ip = self.lab.addresses[self.peer]
        return [["INPUT", "-s", ip, "-j", "DROP"], ["OUTPUT", "-d", ip, "-j", "DROP"]]


class PacketLoss(_RulesFault):
    """Drop each packet entering node ``node`` with ``probability`` (iptables
    statistic match); with ``peer``, only packets from that node."""

    kind = "packet-loss"

    def __init__(self, lab: NetLab, node: int, probability: float, peer: int | None = None, **kw: Any) -> None:
        super().__init__(lab, node, **kw)
        if not 0 < probability <= 1:
            raise ValueError(f"packet-loss probability must be in (0, 1], got {probability}")
        self.probability, self.peer = probability, peer

    def _build(self) -> list[list[str]]:
        match = ["-s", self.lab.addresses[self.peer]] if self.peer is not None else ["!", "-i", "lo"]
        stat = ["-m", "statistic", "--mode", "random", "--probability", f"{self.probability:.4f}"]
        return [["INPUT", *match, *stat, "-j", "DROP"]]
