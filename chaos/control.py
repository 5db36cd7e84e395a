"""The job's side of :class:`~.injectors.ControlRequest`: apply chaos
requests inside the process that can carry them out.

Some faults can only happen inside the job: a bit flip through the SDC hook,
object-store misbehaviour through :class:`~resilient_chaos.faultyfs.FaultyFileSystem`.
The harness writes ``CONTROL_DIR/<id>.json``; a :class:`ControlWatcher`
running in the job (a daemon thread in the worker or the uploader) applies
it with the handler registered for its kind, emits the acknowledgement the
harness waits for (``fault_injected`` with ``request = id``), and undoes it
when ``<id>.clear`` appears. A request whose handler raises is acknowledged
with ``status = "failed"`` so the harness fails fast instead of timing out.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from resilient.events import EventLog

# handler(request) -> undo callable (or None when there is nothing to undo)
Handler = Callable[[dict], Callable[[], Any] | None]


class ControlWatcher:
    """Polls ``control_dir`` for requests of the kinds it has handlers for.

    ``accept(request) -> bool`` filters further (e.g. a bit flip addressed to
    ``params.rank`` is applied only by that rank). Use :meth:`poll` from a
    loop you already have (after each optimizer step, say) or :meth:`start`
    a thread.
    """

    def __init__(self, control_dir: str | Path, log: EventLog, handlers: dict[str, Handler],
                 accept: Callable[[dict], bool] = lambda r: True, interval: timedelta = timedelta(milliseconds=100)) -> None:
        self.control_dir, self.log, self.handlers = Path(control_dir), log, handlers
        self.accept, self.interval = accept, interval
        self.applied: dict[str, Callable[[], Any] | None] = {}
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> int:
        """Apply new requests and clear finished ones; returns how many changed."""
        changed = 0
        if not self.control_dir.is_dir():
            return 0
        for path in sorted(self.control_dir.glob("*.json")):
            rid = path.stem
            if rid in self._seen:
                continue
            try:
                req = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # removed or replaced meanwhile: next poll
            if req.get("kind") not in self.handlers or not self.accept(req):
                continue
            self._seen.add(rid)
            try:
                self.applied[rid] = self.handlers[req["kind"]](req)
                # A handler whose effect comes later (a bit flip at the next
                # step) sets req["deferred_ack"] and acknowledges it itself.
                if not req.get("deferred_ack"):
                    self.log.emit("fault_injected", request=rid, fault=req["kind"], status="injected", params=req.get("params", {}))
            except Exception as e:
                self.log.emit("fault_injected", request=rid, fault=req["kind"], status="failed", detail=f"{type(e).__name__}: {e}")
            changed += 1
        for rid in [r for r in self.applied if (self.control_dir / f"{r}.clear").exists()]:
            undo = self.applied.pop(rid)
            if undo is not None:
                undo()
            self.log.emit("fault_cleared", request=rid)
            changed += 1
        return changed

    def _loop(self) -> None:
        while not self._stop.wait(self.interval.total_seconds()):
            self.poll()

    def start(self) -> "ControlWatcher":
        self._thread = threading.Thread(target=self._loop, name="chaos-control", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval.total_seconds() * 10 + 1)


def faultyfs_handler(target: Any) -> Handler:
    """A storage-flaky handler for the faulty fsspec wrapper: the request's
    mode sets one of the rates (or the latency) of ``target`` — a
    ``FaultPlan``, or a ``FaultyFileSystem`` (its ``.plan``) — until cleared.

    params: ``mode`` ('errors' | 'latency' | 'torn-write'), ``probability``,
    ``latency_ms`` (see :class:`~.scenario.StorageParams`).
    """

    plan = getattr(target, "plan", target)

    def handle(req: dict) -> Callable[[], None]:
        p = req.get("params", {})
        mode = p.get("mode", "errors")
        attr, value = {
            "errors": ("error_rate", float(p.get("probability", 0.3))),
            "torn-write": ("torn_write_rate", float(p.get("probability", 0.3))),
            "latency": ("latency", timedelta(milliseconds=float(p.get("latency_ms", 0.0)))),
        }[mode]
        before = getattr(plan, attr)  # AttributeError: not a fault plan; the ack says so
        setattr(plan, attr, value)
        return lambda: setattr(plan, attr, before)

    return handle
