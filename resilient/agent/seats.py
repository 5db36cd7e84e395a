"""The agent's end of the fail-slow ``replace`` policy: the slow node's agent hands its seat
over, marks the node and lets it back when healthy. (The ranks' end, asking whether a seat
can be handed over, is :mod:`resilient.failslow.replace`.)

It takes the path an SDC quarantine takes (:mod:`resilient.agent.quarantine`), lighter:

1. **Is there anyone to take the seat?** Each agent keeps a small JSON file
   (:data:`~resilient.contract.SEATS_ENV` names it to its workers) saying, from the node registry it
   already reads for lost nodes, whether a warm spare waits (a live node in no
   round, not marked slow) or the job may shrink (more nodes in the round than
   its minimum). At a device or host verdict, every rank reads its agent's file
   and one all-reduce agrees on it and on the re-form's cost
   (:func:`resilient.failslow.replace.agree`):
   the cost model acts only when someone takes the seat, else the job would
   re-form for nothing.
2. **Leave.** Every rank stops after the same step and saves it (as for a
   preemption, :meth:`resilient.job.Job.finish`); the slow node's ranks exit with
   ``WorkerExit.SLOW``, the others with
   ``WorkerExit.PEER_LEFT`` (their agents re-form at once, no restart counted).
3. **Mark.** The slow node's agent (:class:`SeatHandover`) records a mark in
   etcd (:class:`~resilient.agent.quarantine.SlowMarks`: the quarantine's
   sealed records, their own directory), flags itself in the registry (it is
   no spare now), emits ``failslow_mark`` and leaves the rendezvous round: the
   others form the next round with the spare, or without it.
4. **Rejoin.** The agent times the probe's compute (:func:`~.probe.compute_seconds`,
   on the device the ranks ran on) every ``failslow.rejoin_interval`` seconds;
   after ``failslow.rejoin_probes`` in a row within :data:`~.probe.SLOW_COMPUTE`
   of the other ranks' probe time at the decision (the ``failslow_replace``
   event's ``reference_seconds``), and once the others have re-formed without it
   (each agent publishes its round's nodes in its registry entry: any rendezvous
   handler), it clears the mark (``failslow_rejoin``) and joins again: as a spare
   when the round is full. An agent started on a marked node probes the same way first.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from resilient.agent.membership import RegistryReader
from resilient.agent.quarantine import SlowMarks
from resilient.contract import LEAVING, SEATS_ENV, events_path
from resilient.etcd import EtcdError
from resilient.events import read_events
from resilient.failslow.api import FailSlowConfig
from resilient.failslow.probe import SLOW_COMPUTE, compute_seconds

log = logging.getLogger(__name__)

MARKED = "failslow_marked"     # the registry field of a node marked slow (no spare while marked)
ROUND = "failslow_round"       # the registry field with the nodes of the agent's current round
# How long a node that left waits for the others to re-form without it before it may
# rejoin anyway (a re-form takes seconds; a job stuck waiting needs every node it has).
REFORM_WAIT = 60.0

__all__ = ["SeatHandover", "seat_of"]


def seat_of(round_size: int, spares: int, min_nodes: int) -> str:
    """Who would take a leaving node's seat: ``spare``, ``shrink`` or ``none``."""
    if spares > 0:
        return "spare"
    return "shrink" if round_size - 1 >= min_nodes else "none"


class SeatHandover:
    """The agent's end of the ``replace`` policy (module doc). Inactive (every method a
    no-op) unless ``failslow.policy = "replace"`` and the agent has a node registry."""

    def __init__(self, *, node: str, run_id: str, run_dir: str, min_nodes: int, cfg: FailSlowConfig,
                 registry: Any, events: Any, tmp: Path, publish_every: float = 1.0):
        self.cfg = cfg
        self.node, self.run_dir, self.min_nodes = node, Path(run_dir), min_nodes
        self.registry, self.events = registry, events
        self.active = self.cfg.policy == "replace" and registry is not None
        self.path = tmp / "failslow-seats.json"
        self.leaving_path = Path(str(self.path) + LEAVING)
        self.marks = SlowMarks(registry.client, run_id, events=events) if self.active else None
        # Read each second: again only after an entry changed (one small request otherwise).
        self._nodes = RegistryReader(registry.client, run_id, registry.secret, events) if self.active else None
        self.publish_every = publish_every
        self._next_publish = 0.0
        self._round: list[str] = []

    def env(self) -> dict[str, str]:
        """For each worker started: where the seats file is. New workers are not leaving (a
        leaving note their predecessors left behind, e.g. dying while saving, is dropped)."""
        if not self.active:
            return {}
        self.leaving_path.unlink(missing_ok=True)
        return {SEATS_ENV: str(self.path)}

    def leaving(self) -> bool:
        """This node's ranks decided to hand its seat over and are saving their last step: no
        restart now (a spare waiting for that seat must not look like a node to scale up for)."""
        return self.active and self.leaving_path.exists()

    # ------------------------------------------------------------ while training
    def publish(self, round_nodes: set[str]) -> None:
        """Refresh the seats file (at most every ``publish_every``): one read of the registry."""
        if not self.active:
            return
        if sorted(round_nodes) != self._round:
            # Who trains together now, for a node that left: it rejoins only once the others
            # re-formed without it (a round no longer naming it), or it would take its seat back
            self._round = sorted(round_nodes)
            try:
                self.registry.update(**{ROUND: self._round})
            except Exception as e:   # noqa: BLE001 - a leaver then waits REFORM_WAIT at most
                log.warning("could not publish this node's round: %s", e)
        now = time.monotonic()
        if now < self._next_publish:
            return
        self._next_publish = now + self.publish_every
        try:
            alive = self._nodes()
        except EtcdError:
            alive = None
        if alive is None:   # etcd unreachable: unknown, and nobody could re-form now anyway
            seat, spares = "none", []
        else:
            spares = sorted(n for n, d in alive.items() if n not in round_nodes and not d.get(MARKED))
            seat = seat_of(len(round_nodes), len(spares), self.min_nodes)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"seat": seat, "spares": spares, "round": sorted(round_nodes),
                                   "min_nodes": self.min_nodes}))
        os.replace(tmp, self.path)   # a worker never reads half a file

    # ------------------------------------------------------------ leaving, rejoining
    def hand_over(self, local_ranks: list[int], leave_round: Callable[[], None], handler: Any) -> None:
        """This node's workers left with WorkerExit.SLOW: mark the node, leave the round, and return
        once it may rejoin (probed healthy, the others re-formed). Blocks; a signal still
        ends the agent, and a rendezvous closed meanwhile (the job ended) ends its run."""
        note = self._decision()
        self.leaving_path.unlink(missing_ok=True)
        record = {"reason": f"fail-slow: {note.get('cause', 'device')} x{note.get('factor', '?')} "
                            f"at step {note.get('step', '?')} (failslow.policy = replace)",
                  "local_ranks": local_ranks, **{k: note[k] for k in ("step", "cause", "factor", "seat",
                                                                      "reference_seconds", "probe_seconds", "device")
                                                 if k in note}}
        try:
            self.marks.add(self.node, **record)
            self._round = []   # in no round now (publish() names the next one)
            self.registry.update(**{MARKED: True, ROUND: []})
        except Exception as e:  # still leave: the seat goes to the spare either way
            log.error("could not record the slow mark in etcd: %s", e)
        self.events.emit("failslow_mark", node=self.node, **record)
        leave_round()
        self._wait_until_healthy(record, handler, left=True)

    def wait_if_marked(self, handler: Any) -> None:
        """At the agent's start: a node marked slow probes before it joins (module doc)."""
        if not self.active:
            return
        try:
            record = self.marks.get(self.node)
        except Exception as e:   # no etcd now: the join will say so
            log.warning("could not read this node's slow mark: %s", e)
            return
        if record is not None:
            self.registry.update(**{MARKED: True})
            self._wait_until_healthy(record, handler, left=False)

    def _reformed_without_me(self) -> bool:
        """Another live node published a round that does not name this one: the others
        re-formed without it (every round this node was in named it; a spare names none)."""
        alive = self.registry.alive() or {}
        return any(d.get(ROUND) and self.node not in d[ROUND] for n, d in alive.items() if n != self.node)

    def _decision(self) -> dict:
        """What this node's ranks decided (:func:`note_leaving`: the step, the probe's reference
        time, the device), else the newest ``failslow_replace`` event for it in the run dir."""
        try:
            return json.loads(self.leaving_path.read_text())
        except (OSError, ValueError):
            pass
        newest: dict = {}
        try:
            for e in read_events(events_path(self.run_dir)):
                if e.get("event") == "failslow_replace" and e.get("slow_node") == self.node:
                    newest = e
        except OSError:
            pass
        return newest

    def _wait_until_healthy(self, record: dict, handler: Any, left: bool) -> None:
        """Probe until healthy; ``left``: this node just left the round (then also wait for the
        others to re-form without it, else it could take its own seat back from the spare)."""
        from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

        reference, device = record.get("reference_seconds"), record.get("device") or "cpu"
        healthy, attempts, left_at = 0, 0, time.monotonic()
        seconds = ratio = None
        while True:
            if _closed(handler):
                raise RendezvousGracefulExitError(f"the job ended while node {self.node} was marked slow")
            attempts += 1
            seconds = compute_seconds(device)
            ratio = seconds / reference if reference else None
            healthy = healthy + 1 if ratio is None or ratio < SLOW_COMPUTE else 0
            reformed = not left or time.monotonic() - left_at > REFORM_WAIT or self._reformed_without_me()
            if healthy >= self.cfg.rejoin_probes and reformed:
                break
            log.info("node %s marked slow: probe %.4f s (reference %s), %d healthy in a row", self.node, seconds,
                     reference, healthy)
            time.sleep(self.cfg.rejoin_interval)
        try:
            self.marks.clear(self.node)
            self.registry.update(**{MARKED: False})
        except Exception as e:  # the mark stays: the next start probes again, nothing worse
            log.warning("could not clear the slow mark: %s", e)
        self.events.emit("failslow_rejoin", node=self.node, probe_seconds=round(seconds, 6),
                         reference_seconds=reference, ratio=round(ratio, 4) if ratio is not None else None,
                         probes=attempts, healthy_in_a_row=healthy, marked_seconds=round(time.monotonic() - left_at, 3))


def _closed(handler: Any) -> bool:
    try:
        return bool(handler.is_closed())
    except Exception:   # noqa: BLE001 - unknown is not closed
        return False
