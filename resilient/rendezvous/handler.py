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
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

log = logging.getLogger(__name__)

__all__ = ["ResilientRendezvousHandler"]


class ResilientRendezvousHandler(DynamicRendezvousHandler):
    """See the module docstring. Built with ``from_backend`` like torch's."""

    # The round this node last completed and its members, recorded when the join
    # finished (torch asks _get_world right then, before any store wait).
    _joined: tuple[int, frozenset] | None = None

    def next_rendezvous(self):
        # A new join: the previous round's members are no longer the reference.
        self._joined = None
        return super().next_rendezvous()

    def _get_world(self) -> tuple[int, int]:
        state = self._state_holder.state
        self._joined = (state.round, frozenset(state.participants))
        return super()._get_world()

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
