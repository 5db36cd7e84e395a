"""torch's ``DynamicRendezvousHandler`` with two fixes the chaos soak needed.

1. **No scale-up churn with a spare node.** torch's agent restarts a healthy
   group whenever ``num_nodes_waiting() > 0``, and torch counts every node in
   the state's ``wait_list``. A node that joined the wait list while a round
   had room (a member had just left) stays there when the next round fills up
   to ``max_nodes`` without it (the join op only moves *new* arrivals to the
   redundancy list). The full group then restarts for a node it cannot admit,
   the new round leaves one node out again, and so on: measured with 3 nodes
   + 1 spare (``--nnodes 2:3``), a round every ~2 s for minutes, no step
   trained. A waiting node counts only while the completed round has room.

2. **A round whose member died after it completed is abandoned promptly.**
   Once a round completes, torch's handler and agent wait in the store for
   the other members (rank 0's MASTER_ADDR, our agents' node ids) for the
   whole store timeout (300 s). :meth:`round_lost` tells why this node's
   round can no longer start (a member's keep-alive lapsed, a new round
   began); the etcd store asks it while it waits and raises
   :class:`~.api.RendezvousRoundLost`, and the agent joins the next round.

Two more make a round re-form in about a second instead of four to five:

3. **A dead member is evicted on proof, not after its keep-alive lapses.**
   :meth:`evict` takes a prober from the agent; a member the prober proves
   gone (its agent's port refuses connections: the process is dead while its
   host answers) gets its last keep-alive set to the epoch, so every node's
   next read drops it (torch's sanitizer) at once. Without proof nothing is
   evicted and the keep-alive expiry (``keep_alive_interval ×
   keep_alive_max_attempt``) still applies; a node wrongly evicted finds
   itself out of the round and re-joins.

4. **Fast polling while joining.** torch's join loop reads the shared state,
   then sleeps 1 s whenever it must wait (its ``SYNC`` action), and caches
   the state for 1 s; a round's steps (exit, join, the last call, the
   completion) each cost up to a second. While joining, this handler reads
   every ``poll`` instead (``poll_interval``, default 0.1 s): one small etcd
   read per joining node per poll, spare nodes waiting for a seat included,
   which is what lets a standby node take a dead node's seat at once.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta, timezone
from typing import Callable

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

log = logging.getLogger(__name__)

__all__ = ["ResilientRendezvousHandler", "install_fast_polling"]

# A keep-alive this old is expired under any settings: torch's sanitizer drops the node.
_EXPIRED = datetime(1970, 1, 1, tzinfo=timezone.utc)
# torch's join loop waits with _delay(seconds=1); per thread, how fast to poll instead while joining.
_joining = threading.local()
_torch_delay = dynamic_rendezvous._delay


def _delay(seconds: float | tuple[float, float]) -> None:
    if seconds == 1 and getattr(_joining, "poll", None):
        seconds = _joining.poll
    _torch_delay(seconds)


def install_fast_polling() -> None:
    """Route torch's join-loop sleep through :func:`_delay` (idempotent). Only threads inside
    :meth:`ResilientRendezvousHandler.next_rendezvous` poll faster; others sleep as before."""
    dynamic_rendezvous._delay = _delay


class ResilientRendezvousHandler(DynamicRendezvousHandler):
    """See the module docstring. Built with ``from_backend`` like torch's."""

    # The round this node last completed and its members, recorded when the join
    # finished (torch asks _get_world right then, before any store wait).
    _joined: tuple[int, frozenset] | None = None
    # How often a join reads the shared state (see module doc).
    poll: timedelta = timedelta(seconds=0.1)

    @property
    def node_desc(self) -> str:
        """This node's name in the shared state (``addr_pid_localid``), for :meth:`evict` probers."""
        return repr(self._this_node)

    def next_rendezvous(self):
        # A new join: the previous round's members are no longer the reference.
        self._joined = None
        holder = self._state_holder
        cache = holder._cache_duration
        holder._cache_duration = self.poll.total_seconds()
        _joining.poll = self.poll.total_seconds()
        try:
            return super().next_rendezvous()
        finally:
            _joining.poll = None
            holder._cache_duration = cache

    def evict(self, is_dead: Callable[[list[str]], set[str]], attempts: int = 3) -> list[str]:
        """Expire the keep-alive of every other node in the shared state that ``is_dead``
        (given their ``node_desc`` names, returning the proven dead) proves gone.
        Returns the names evicted. The probe runs outside the state lock: torch's
        keep-alive thread shares it."""
        with self._heartbeat_lock:
            self._state_holder.sync()
            state = self._state_holder.state
            others = {repr(n): n for n in state.last_heartbeats if n != self._this_node}
        dead = is_dead(sorted(others)) & set(others) if others else set()
        for _ in range(attempts if dead else 0):
            with self._heartbeat_lock:
                self._state_holder.sync()
                beats = self._state_holder.state.last_heartbeats
                here = [others[d] for d in dead if others[d] in beats]
                if not here:
                    break
                for n in here:
                    beats[n] = _EXPIRED
                self._state_holder.mark_dirty()
                if self._state_holder.sync():  # False: another node wrote first; read it and retry
                    break
        if dead:
            log.warning("evicted from the rendezvous, proven dead: %s", ", ".join(sorted(dead)))
        return sorted(dead)

    def _get_world(self) -> tuple[int, int]:
        state = self._state_holder.state
        self._joined = (state.round, frozenset(state.participants))
        self._by_rank = [repr(n) for n, _ in sorted(state.participants.items(), key=lambda item: item[1])]
        return super()._get_world()

    def members_by_rank(self) -> list[str]:
        """The names (as :meth:`evict` gives them) of this node's round's members, by rank."""
        return list(getattr(self, "_by_rank", []))

    def num_nodes_waiting(self) -> int:
        with self._heartbeat_lock:
            self._state_holder.sync()
            state = self._state_holder.state
            if state.complete and len(state.participants) >= self._settings.max_nodes:
                # Full: a restart could not admit the waiting node, it would only evict another.
                return 0
            return len(state.wait_list)

    def round_lost(self) -> str | None:
        """Why this node's current round cannot go on, or None while it can.

        Reads the shared state (at most once per torch's 1 s state cache), which
        also drops members whose keep-alive lapsed (torch's sanitizer:
        ``keep_alive_interval × keep_alive_max_attempt``).
        """
        if self._joined is None:  # not in a completed round: nothing of ours to lose
            return None
        with self._heartbeat_lock:
            self._state_holder.sync()
            state = self._state_holder.state
        round_, before = self._joined
        if state.closed:
            return "the rendezvous was closed"
        if state.round != round_:
            return f"round {round_} was replaced by round {state.round}"
        if self._this_node not in state.participants:
            return f"this node is no longer a participant of round {round_}"
        gone = before - frozenset(state.participants)
        if gone:
            return (f"member(s) {', '.join(sorted(str(n) for n in gone))} of round {round_} "
                    f"stopped sending keep-alives")
        return None
