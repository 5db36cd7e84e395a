"""The worker's end of the chaos control channel: bit flips on request.

Why through the job's own flip list: a worker's :class:`resilient.Job`
(the built-in trainer's and any user script's) already applies
:class:`~resilient.sdc.inject.BitFlipInjector` s from ``Job.flips`` at the
points where a flip means something (gradients after backward, parameters and
optimizer state after the optimizer step). A chaos request only has to *add*
an injector to that list; the job fires it at its next hook point. So the harness needs no second set of hook
points, and a campaign's flips are exactly the flips a ``[sdc] inject``
config makes.

Enabled only when the chaos runner started the job: it sets
``RESILIENT_CHAOS_CONTROL`` to the control directory and names
:meth:`WorkerHooks.attach` in ``RESILIENT_WORKER_HOOKS``, the Job's public
extension point (the runtime never imports this package);
:meth:`WorkerHooks.attach` returns None without a control directory (a
normal run starts no thread and reads no directory).

A request (``{"kind": "bitflip", "params": {rank, target, tensor, bit,
element, persistent, state_key}}``, see :class:`~.scenario.BitflipParams`) is
taken only by its rank. It is acknowledged — the ``fault_injected`` event
with ``request = id`` the harness waits for — only when the bit has really
flipped, carrying the old and new value; a request that cannot be carried
out (no such tensor) is acknowledged as failed at once.

A ``storage-flaky`` request (``{"mode": "errors" | "latency" | "torn-write",
"probability", "latency_ms"}``) is taken by every rank: each sets the rate on
its process's :func:`~.faultyfs.process_plan`, the plan of the durable tier's
filesystem when ``snapshot.durable_url`` is a ``faulty::`` URL (the runner
makes it one for a scenario with storage faults). It is acknowledged when the
wrapper has really struck (an operation failed, was torn or delayed), naming
what and where; a rank whose durable tier is not faulty refuses the request.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from resilient.events import EventLog

from .control import ControlWatcher

CONTROL_ENV = "RESILIENT_CHAOS_CONTROL"


def _next_step_injector(spec: Any, rank: int, log: Callable[[dict], None]) -> Any:
    """A BitFlipInjector that fires once at the first hook point of step ≥
    ``spec.step`` (a request lands mid-step: the exact step would be a race
    with the training thread, and a missed flip would time the request out)."""
    from resilient.sdc.inject import BitFlipInjector

    class NextStep(BitFlipInjector):
        def _due(self, step: int) -> bool:
            if self.rank != self.spec.rank:
                return False
            return step >= self.spec.step and (self.spec.persistent or self.fired == 0)

    return NextStep(spec, rank, log=log)


class WorkerHooks:
    """Polls the control directory (a daemon thread) and turns this rank's
    bit-flip requests into injectors on ``flips``, the job's list.

    ``model`` has ``named_parameters()``; ``step_of()`` returns the job's
    completed steps (the flip goes into the next one).
    """

    def __init__(self, control_dir: str | os.PathLike, events: EventLog, rank: int, model: Any, flips: list,
                 step_of: Callable[[], int]) -> None:
        self.events, self.rank, self.model, self.flips, self.step_of = events, rank, model, flips, step_of
        self.watcher = ControlWatcher(control_dir, events, {"bitflip": self._on_bitflip, "storage-flaky": self._on_storage},
                                      accept=lambda r: r.get("kind") == "storage-flaky"
                                      or int(r.get("params", {}).get("rank", -1)) == self.rank)

    @classmethod
    def attach(cls, job: Any) -> "WorkerHooks | None":
        """Called by ``Job.__init__`` (``RESILIENT_WORKER_HOOKS``) with the job: start the
        watcher when the chaos runner launched this job; None otherwise."""
        path = os.environ.get(CONTROL_ENV)
        if not path:
            return None
        hooks = cls(path, job.events, job.rank, job.model, job.flips, lambda: job.step)
        hooks.watcher.start()
        return hooks

    def close(self) -> None:
        self.watcher.stop()

    def _on_storage(self, req: dict) -> Callable[[], None]:
        """Flip the process plan's rate; acknowledge at the first strike."""
        from .control import faultyfs_handler
        from .faultyfs import process_plan

        plan, rid = process_plan(), str(req.get("id"))
        if plan.users == 0:
            raise RuntimeError("no faulty:: filesystem in this worker: snapshot.durable_url is not a faulty:: URL")
        fired = threading.Event()

        def strike(what: str, path: str) -> None:
            if not fired.is_set():
                fired.set()
                self.events.emit("fault_injected", request=rid, fault="storage-flaky", status="injected",
                                 effect=what, path=path, params=req.get("params", {}))

        unlisten = plan.listen(strike)
        undo = faultyfs_handler(plan)(req)
        req["deferred_ack"] = True

        def clear() -> None:
            unlisten()
            undo()
        return clear

    def _on_bitflip(self, req: dict) -> Callable[[], None]:
        """Build the FlipSpec and queue it; the acknowledgement is emitted by
        the injector's log when the bit flips (``deferred_ack``). Raising
        here acknowledges the request as failed."""
        from resilient.sdc.inject import HOOKED, MODULE_TARGETS, FlipSpec

        rid = str(req.get("id"))
        p = {k: v for k, v in req.get("params", {}).items() if k in FlipSpec.__dataclass_fields__}
        names = [n for n, _ in self.model.named_parameters()]
        if not p.get("tensor"):
            p["tensor"] = names[0]
        if p.get("target") not in MODULE_TARGETS and p["tensor"] not in names:
            raise KeyError(f"no parameter {p['tensor']!r} on rank {self.rank}; e.g. {names[:4]}")
        p["step"], p["rank"] = self.step_of() + 1, self.rank
        spec = FlipSpec.from_dict(p)

        def acknowledge(rec: dict) -> None:
            if inj.fired == 1:  # a persistent flip acknowledges its first strike only
                self.events.emit("fault_injected", request=rid, fault="bitflip", status="injected", result=rec,
                                 params=req.get("params", {}))

        inj = _next_step_injector(spec, self.rank, acknowledge)
        if spec.target in HOOKED:
            inj.attach(self.model)
        self.flips.append(inj)
        req["deferred_ack"] = True
        return lambda: self.flips.remove(inj) if inj in self.flips else None
