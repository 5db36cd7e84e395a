"""The embedded etcd grows into a cluster across the agents of a run dir: no agent is special.

Why: the embedded etcd used to be one member in its owner's process tree, so losing that
one agent (its node) ended the job for every node, whatever the others still held (issue
38). Here, once agents join, the etcd becomes a cluster of ``launch.etcd_members`` (3 or 5;
the default, 1, keeps the owner's member alone) members, one per agent: losing any one agent, its etcd member and that member's
data, leaves a majority that goes on.

How (etcd's runtime reconfiguration, safe on a loaded host):

- A joining agent takes the grow guard (a key created only if absent, on a lease of its
  own: a joiner killed halfway frees it), so two joiners never reconfigure at once.
- It adds itself as a *learner* (a member that counts for no quorum) with the peer URL it
  will listen on, starts its etcd with ``--initial-cluster-state existing`` (data and
  authentication come from the cluster; TLS from the same job secret, on this node), and is
  promoted to a voting member once it caught up. Not a voting member at once: etcd's strict
  reconfiguration check would count a member that is not started yet against the quorum.
- A second agent stays a learner: a cluster of two voters would lose its quorum with
  *either* agent, a learner with neither of them but the first. The third agent promotes
  it, then adds and promotes itself: three voters, any one of which may be lost. etcd 3.4
  allows one learner at a time.
- Each member is marked by a key on its agent's lease (``etcd-members/<member id>``). A
  member whose mark lapsed *and* whose etcd does not answer is dead (two signals: a stalled
  agent's etcd still answers); a tending thread in every agent removes it, and an agent
  without a member (a standby) takes its place when the cluster has room.
- An agent that leaves at the end removes its member first (after the dead ones), so the
  last agents never wait on a quorum of members that are gone.

Clients learn the members (``auto_sync`` of :class:`~resilient.etcd.client.EtcdClient`,
the ``auto_sync`` key of the embedded etcd's rdzv conf) and fail over between them. With
fewer than three agents the job depends on the first one's member (it says so at start).
The members listen on loopback: this is the cluster of one machine's agents (a run dir's
claim is per machine); across machines, ``--rdzv-endpoint`` names an operator's cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

from resilient.etcd.api import EtcdError
from resilient.etcd.client import voter_urls
from resilient.errors import LaunchError

__all__ = ["MemberSettings", "ClusterMember", "GUARD", "MARKS", "voter_endpoints"]

log = logging.getLogger(__name__)

GUARD = "/resilient/control/etcd-grow"
MARKS = "/resilient/control/etcd-members/"


@dataclass(frozen=True)
class MemberSettings:
    """``members``: the cluster's size (``launch.etcd_members``; 1 = the owner's member alone).
    ``catch_up``: how long a learner may take to catch up before its promotion is given up
    (it stays a learner, the job goes on). ``guard_wait``: how long a joiner waits for another
    joiner's reconfiguration. ``mark_ttl``: the lease of a member's mark (its agent's life).
    ``tend_every``: how often each agent looks for dead members to remove and replace."""

    members: int = 3
    catch_up: timedelta = timedelta(seconds=60)
    guard_wait: timedelta = timedelta(seconds=180)
    mark_ttl: timedelta = timedelta(seconds=10)
    tend_every: timedelta = timedelta(seconds=5)
    probe: timedelta = timedelta(seconds=3)
    election_ms: int = 1000   # a cluster's raft on a loaded host: longer than one member's 250 ms


def voter_endpoints(members: list[dict]) -> str:
    """``host:port,...`` of the voting members' client URLs (the rdzv endpoint form)."""
    from urllib.parse import urlsplit

    return ",".join(urlsplit(u).netloc for u in voter_urls(members))


class ClusterMember:
    """This agent's part in the run dir's etcd cluster (module doc). ``client``: logged in as
    root with the job secret's TLS (an :class:`~resilient.etcd.client.EtcdClient`, auto-syncing);
    ``make_etcd(name, join)``: an unstarted :class:`~resilient.etcd.server.EmbeddedEtcd` of this
    node that joins the members ``join`` (its ports not chosen yet)."""

    def __init__(self, client, node: str, make_etcd: Callable, probe_client: Callable[[str], object],
                 settings: MemberSettings = MemberSettings(), say: Callable[[str], None] = log.info,
                 on_change: Callable[[list[dict]], None] | None = None) -> None:
        self.client, self.node, self.make_etcd, self.probe_client = client, node, make_etcd, probe_client
        self.settings, self.say, self.on_change = settings, say, on_change
        self.etcd = None           # our member's server, when we run one (not the owner's: the plane keeps that)
        self.member_id: int | None = None
        self._mark_lease = None
        self._stop = threading.Event()
        self._left = threading.Event()   # leave() is done: the tending thread may end (module doc of server.py: pdeathsig)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()   # tend() and leave() never reconfigure at once

    # ------------------------------------------------------------ marks
    def mark(self, member_id: int | str) -> None:
        """Mark ``member_id`` as this agent's (a key on a lease this agent keeps alive)."""
        if self._mark_lease is None:
            self._mark_lease = self.client.lease(self.settings.mark_ttl)
        self.member_id = int(member_id)
        self.client.put(MARKS + str(self.member_id), json.dumps({"node": self.node, "pid": os.getpid()}),
                        lease=self._mark_lease)

    def _marked(self) -> set[int]:
        return {int(k.decode()[len(MARKS):]) for k in self.client.prefix_keys(MARKS)
                if k.decode()[len(MARKS):].isdigit()}

    def _answers(self, member: dict) -> bool:
        urls = member.get("clientURLs") or []
        if not urls:
            return False   # added, never started
        try:
            with self.probe_client(urls[0]) as c:
                c.check(self.settings.probe)
            return True
        except EtcdError:
            return False

    def dead_members(self, members: list[dict] | None = None) -> list[dict]:
        """Members whose mark lapsed and whose etcd does not answer (never ours)."""
        members = self.client.members() if members is None else members
        marked = self._marked()
        return [m for m in members if int(m["ID"]) != self.member_id and int(m["ID"]) not in marked
                and not self._answers(m)]

    def _remove_dead(self, members: list[dict]) -> list[dict]:
        for m in self.dead_members(members):
            try:
                self.client.member_remove(m["ID"], retry_timeout=timedelta(seconds=10))
                self.say(f"removed etcd member {m.get('name') or m['ID']} ({', '.join(m.get('peerURLs') or [])}): "
                         "its agent is gone and it does not answer")
            except EtcdError as e:
                log.warning("could not remove the dead etcd member %s: %s", m["ID"], e)
            self.changed()
        return self.client.members()

    def changed(self) -> None:
        """Tell ``on_change`` the members now (the plane seals them in the run dir, where an
        agent that claims the run dir after the first one is gone finds the cluster)."""
        if self.on_change is None:
            return
        try:
            self.on_change(self.client.members())
        except (EtcdError, OSError) as e:
            log.debug("recording the etcd members: %s", e)

    # ------------------------------------------------------------ the guard
    @contextlib.contextmanager
    def _guard(self, wait: timedelta | None = None, leaving: bool = False) -> Iterator[None]:
        wait = self.settings.guard_wait if wait is None else wait
        lease = self.client.lease(timedelta(seconds=30))
        deadline = time.monotonic() + wait.total_seconds()
        try:
            while not self.client.compare_and_swap(GUARD, f"{self.node} {os.getpid()}", mod_revision=None,
                                                   lease=lease).succeeded:
                if time.monotonic() > deadline or (self._stop.is_set() and not leaving):
                    raise LaunchError(
                        f"another agent has been changing this run dir's etcd members for "
                        f"{wait.total_seconds():.0f} s (key {GUARD}); this agent goes on "
                        "as a client of the cluster without a member of its own")
                time.sleep(0.5)
            yield
        finally:
            try:
                lease.revoke()   # the guard goes with it
            except EtcdError:
                pass

    # ------------------------------------------------------------ growing
    def _promote(self, member: dict) -> bool:
        deadline = time.monotonic() + self.settings.catch_up.total_seconds()
        while True:
            try:
                self.client.member_promote(member["ID"])
                return True
            except EtcdError as e:
                text = str(e).lower()
                if "member not found" in text:
                    return False   # removed meanwhile (its agent is gone)
                if "can only promote a learner" in text and "in sync" not in text:
                    return True    # a voting member already
                if time.monotonic() > deadline:
                    log.warning("etcd learner %s did not catch up in %s: it stays a learner (%s)",
                                member.get("name") or member["ID"], self.settings.catch_up, e)
                    return False
                time.sleep(0.2)

    def join(self) -> bool:
        """Add this agent's member to the cluster if it has room (module doc); True if it did."""
        if self.settings.members <= 1 or self.etcd is not None:
            return False
        with self._lock, self._guard():
            members = self._remove_dead(self.client.members())
            if len(members) >= self.settings.members:
                return False
            learners = [m for m in members if m.get("isLearner")]
            for learner in learners:   # etcd 3.4: one learner at a time; ours comes next
                if not self._promote(learner):
                    return False
            voters = len(members)
            etcd = self.make_etcd(f"{self.node}-{os.getpid()}",
                                  [(m["name"], m["peerURLs"][0]) for m in members if m.get("peerURLs")])
            from resilient.etcd.server import free_port

            if threading.current_thread() is self._thread:
                etcd.forks_from = self._thread   # it outlives the server (_tend_loop): pdeathsig stays right
            etcd.client_port, etcd.peer_port = free_port(etcd.host), free_port(etcd.host)
            added = self.client.member_add([etcd.peer_url], learner=True)
            try:
                self.mark(added["ID"])
                etcd.start()
                etcd.watch(on_restart=lambda code, secs: self.say(
                    f"this agent's etcd member {etcd.endpoint} died (exit code {code}); restarted it in {secs:.1f} s"))
            except BaseException:
                etcd.close()
                with contextlib.suppress(EtcdError):
                    self.client.member_remove(added["ID"], retry_timeout=timedelta(seconds=10))
                self.member_id = None
                raise
            self.etcd = etcd
            role = "a learner (it counts for no quorum until a third agent joins)"
            if voters + 1 >= self.settings.members and self._promote(added):
                role = f"a voting member ({voters + 1} of {self.settings.members})"
            self.say(f"this agent's etcd member {etcd.endpoint} joined the run dir's etcd cluster as {role}")
            self.changed()
            return True

    # ------------------------------------------------------------ tending and leaving
    def tend(self) -> None:
        """One look: remove dead members; join if we have no member and the cluster has room."""
        try:
            if self._mark_lease is not None and self._mark_lease.expired and self.member_id is not None:
                # This agent stalled past the mark's lease (a loaded host): mark our member again.
                self._mark_lease = None
                self.mark(self.member_id)
            members = self.client.members()
            if self.dead_members(members):
                with self._lock, self._guard():
                    members = self._remove_dead(self.client.members())
            if self.etcd is None and self.member_id is None and len(members) < self.settings.members:
                self.join()
        except (EtcdError, LaunchError) as e:
            log.debug("tending the etcd cluster: %s", e)

    def start_tending(self) -> None:
        if self.settings.members <= 1 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._tend_loop, name="etcd-members", daemon=True)
        self._thread.start()

    def _tend_loop(self) -> None:
        while not self._stop.wait(self.settings.tend_every.total_seconds()):
            self.tend()
        # An etcd started from this thread dies when it ends (pdeathsig): not before leave() stopped it.
        self._left.wait(60)

    def leave(self) -> None:
        """At the end: stop tending; under the guard, remove the members that do not answer (a
        lost agent's, whose mark may not have lapsed yet) and then ours, unless ours is the last;
        then stop our etcd. In that order, one agent at a time: the agents still there keep a
        quorum for their last calls. Bounded: a cluster without quorum is left as it is."""
        self._stop.set()
        # Short bounds from here: a cluster that lost its quorum must not hold the agent's exit.
        self.client.retry_timeout = min(self.client.retry_timeout, timedelta(seconds=5))
        with self._lock:
            if self.member_id is not None:
                try:
                    with self._guard(wait=timedelta(seconds=30), leaving=True):
                        for m in self.client.members():
                            if int(m["ID"]) != self.member_id and not self._answers(m):
                                self.client.member_remove(m["ID"])
                                self.say(f"removed etcd member {m.get('name') or m['ID']}: it does not answer")
                        members = self.client.members()
                        if len(members) > 1 and any(int(m["ID"]) == self.member_id for m in members):
                            self.client.member_remove(self.member_id)
                            self.changed()
                except (EtcdError, LaunchError) as e:
                    log.info("leaving the etcd cluster: %s", e)
            if self._mark_lease is not None:
                with contextlib.suppress(EtcdError):
                    self._mark_lease.revoke()
            if self.etcd is not None:
                self.etcd.close()
        self._left.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=30)
