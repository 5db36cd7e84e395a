"""Fault injectors: make a fault happen, and prove it happened.

Every injector derives from :class:`Injector`. ``inject()`` returns an
:class:`InjectionRecord` whose status is ``"injected"`` only after the effect
was *observed* (the process is gone, stopped, the port refuses, the consumer
acknowledged); an injector that could not inject raises
:class:`InjectionFailed`, because a fault that silently did not happen would
let a campaign pass for the wrong reason. An injector that cannot run here
(missing privileges or tools) returns status ``"skipped"`` with the reason,
which the report shows; it never counts as injected.

Targets are resolved at injection time (a pid, a :class:`psutil.Process`, or a
callable returning pids), because the processes of an elastic job change with
every restart.
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Union

import psutil

from resilient.errors import ResilientError
from resilient.events import EventLog

from .timeline import EventTail

PidSource = Union[int, psutil.Process, Callable[[], Union[int, Iterable[int]]]]

DEFAULT_SETTLE = timedelta(seconds=5)


class InjectionFailed(ResilientError):
    """A fault could not be injected (or its effect was not observed).

    A campaign with such a fault is broken, not passed: fix the target (is the
    pid stale? is the consumer of control requests running?) and rerun.
    """


@dataclass
class InjectionRecord:
    """What one injector did: the report's row for a fault."""

    kind: str
    target: str
    status: str  # "injected", "skipped", "cleared"
    fault_id: str = ""
    injected_at: float | None = None
    cleared_at: float | None = None
    detail: str = ""
    pids: list[int] = field(default_factory=list)

    def event_fields(self) -> dict:
        """Fields for a ``fault_injected`` / ``fault_cleared`` event."""
        d = asdict(self)
        d["fault"] = d.pop("kind")
        return d


def emit_record(log: EventLog, record: InjectionRecord, cleared: bool = False) -> dict:
    """Write the record to the run's event log as fault_injected/fault_cleared.

    The harness writes to its own ``events.jsonl`` (node "chaos"), which the
    timeline merges with the agents' and workers' logs.
    """
    return log.emit("fault_cleared" if cleared else "fault_injected", **record.event_fields())


class Injector(abc.ABC):
    """Base of all injectors: ``inject()`` then ``clear()`` (idempotent).

    Subclasses implement :meth:`_inject` (return a detail string once the
    effect is observed, raise :class:`InjectionFailed` otherwise) and may
    implement :meth:`_clear` and :meth:`preflight` (return a skip reason).
    Usable as a context manager, which clears even when the body fails.
    """

    kind: str = "fault"

    def __init__(self, target: str = "", fault_id: str = "") -> None:
        self.target = target
        self.fault_id = fault_id or uuid.uuid4().hex[:8]
        self.record: InjectionRecord | None = None
        self._active = False

    def preflight(self) -> str | None:
        """A reason this injector cannot run here, or None."""
        return None

    @abc.abstractmethod
    def _inject(self) -> str: ...

    def _clear(self) -> None:
        return None

    def inject(self) -> InjectionRecord:
        reason = self.preflight()
        rec = InjectionRecord(self.kind, self.target, "skipped", self.fault_id, time.time())
        if reason:
            rec.detail = f"skipped: {reason}"
            self.record = rec
            return rec
        rec.detail = self._inject()
        rec.status = "injected"
        rec.pids = list(getattr(self, "pids", []) or [])
        self._active = True
        self.record = rec
        return rec

    def clear(self) -> InjectionRecord | None:
        if not self._active:
            return self.record
        self._active = False
        self._clear()
        assert self.record is not None
        self.record.status = "cleared"
        self.record.cleared_at = time.time()
        return self.record

    def __enter__(self) -> "Injector":
        self.inject()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.clear()


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------
def resolve_pids(source: PidSource) -> list[int]:
    """Pids from an int, a psutil.Process, or a callable returning either."""
    if callable(source) and not isinstance(source, psutil.Process):
        source = source()
    if isinstance(source, psutil.Process):
        return [source.pid]
    if isinstance(source, int):
        return [source]
    return [int(p) for p in source]


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (a "node": agent + workers)."""
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: list[psutil.Process], timeout: timedelta) -> list[psutil.Process]:
    """Processes still alive (not zombies) after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if _alive(p)]
    return alive


def _signal_all(procs: list[psutil.Process], sig: int) -> list[psutil.Process]:
    sent = []
    for p in procs:
        try:
            p.send_signal(sig)
            sent.append(p)
        except psutil.NoSuchProcess:
            pass
    return sent


def _procs_of(source: PidSource, tree: bool) -> list[psutil.Process]:
    pids = resolve_pids(source)
    if not pids:
        raise InjectionFailed("no process to inject into: the target resolved to no pid")
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            procs.extend(process_tree(pid) if tree else [psutil.Process(pid)])
        except psutil.NoSuchProcess:
            raise InjectionFailed(f"process {pid} does not exist (stale pid?)") from None
    return procs


class KillProcess(Injector):
    """SIGKILL one process (a worker), or its whole tree (``tree=True``: a
    node = agent + workers). The tree is SIGSTOPped first so the agent cannot
    respawn workers between kills. ``shm_paths`` (e.g. the node's
    /dev/shm store) are deleted too: a lost node loses its RAM."""

    kind = "kill-worker"

    def __init__(self, source: PidSource, *, tree: bool = False, shm_paths: Callable[[], Iterable[str]] | Iterable[str] = (), settle: timedelta = DEFAULT_SETTLE, **kw: Any) -> None:
        super().__init__(**kw)
        self.source, self.tree, self.shm_paths, self.settle = source, tree, shm_paths, settle
        self.pids: list[int] = []
        if tree:
            self.kind = "kill-node"

    def _inject(self) -> str:
        procs = _procs_of(self.source, self.tree)
        self.pids = [p.pid for p in procs]
        # Resolved while the node still runs: what it maps can be read from
        # /proc only while its processes exist.
        paths = list(self.shm_paths() if callable(self.shm_paths) else self.shm_paths)
        if self.tree:
            _signal_all(procs, signal.SIGSTOP)
        _signal_all(procs, signal.SIGKILL)
        left = _wait_gone(procs, self.settle)
        if left:
            raise InjectionFailed(f"SIGKILL sent but pids {[p.pid for p in left]} still alive after {self.settle}")
        removed = []
        for path in paths:
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)  # a node store is a tmpfs tree
                else:
                    os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        extra = f"; removed {len(removed)} shm entries" if removed else ""
        return f"SIGKILL → pids {self.pids}, all gone{extra}"


class HangProcess(Injector):
    """SIGSTOP the target (a hung process: alive, silent), SIGCONT on clear.

    The effect is observed in the kernel's process state ('T' stopped).
    """

    kind = "hang"

    def __init__(self, source: PidSource, *, tree: bool = False, settle: timedelta = DEFAULT_SETTLE, **kw: Any) -> None:
        super().__init__(**kw)
        self.source, self.tree, self.settle = source, tree, settle
        self.procs: list[psutil.Process] = []
        self.pids: list[int] = []

    def _wait_state(self, stopped: bool) -> list[psutil.Process]:
        deadline = time.monotonic() + self.settle.total_seconds()
        while True:
            wrong = []
            for p in self.procs:
                try:
                    if (p.status() == psutil.STATUS_STOPPED) != stopped and _alive(p):
                        wrong.append(p)
                except psutil.NoSuchProcess:
                    pass
            if not wrong or time.monotonic() > deadline:
                return wrong
            time.sleep(0.01)

    def _inject(self) -> str:
        self.procs = _procs_of(self.source, self.tree)
        self.pids = [p.pid for p in self.procs]
        _signal_all(self.procs, signal.SIGSTOP)
        wrong = self._wait_state(stopped=True)
        if wrong:
            raise InjectionFailed(f"SIGSTOP sent but pids {[p.pid for p in wrong]} are not stopped")
        return f"SIGSTOP → pids {self.pids}, all in state stopped"

    def _clear(self) -> None:
        _signal_all(self.procs, signal.SIGCONT)
        wrong = self._wait_state(stopped=False)
        if wrong:
            raise InjectionFailed(f"SIGCONT sent but pids {[p.pid for p in wrong]} are still stopped")


class Preempt(Injector):
    """SIGTERM, then SIGKILL after ``grace`` if still alive: a preemption
    notice. ``inject()`` returns at once (the grace period runs in a thread);
    ``wait()`` blocks until the target is gone and says whether it left
    within the grace period. ``tree=True`` signals the agent only but kills
    the whole tree when the grace period ends."""

    kind = "preemption"

    def __init__(self, source: PidSource, *, grace: timedelta, tree: bool = False, settle: timedelta = DEFAULT_SETTLE, **kw: Any) -> None:
        super().__init__(**kw)
        self.source, self.grace, self.tree, self.settle = source, grace, tree, settle
        self.pids: list[int] = []
        self.outcome: str = ""
        self._thread: threading.Thread | None = None

    def _inject(self) -> str:
        roots = _procs_of(self.source, tree=False)
        procs = _procs_of(self.source, tree=self.tree)
        self.pids = [p.pid for p in procs]
        if not _signal_all(roots, signal.SIGTERM):
            raise InjectionFailed(f"SIGTERM could not be delivered to {[p.pid for p in roots]}: already gone")
        self._thread = threading.Thread(target=self._finish, args=(procs,), name=f"preempt-{self.fault_id}", daemon=True)
        self._thread.start()
        return f"SIGTERM → pids {[p.pid for p in roots]}, SIGKILL after {self.grace}"

    def _finish(self, procs: list[psutil.Process]) -> None:
        left = _wait_gone(procs, self.grace)
        if not left:
            self.outcome = "exited within the grace period"
        else:
            _signal_all(left, signal.SIGKILL)
            still = _wait_gone(left, self.settle)
            self.outcome = f"SIGKILL after grace → pids {[p.pid for p in left]}" + (f"; {len(still)} survived SIGKILL" if still else "")
        if self.record is not None:
            self.record.detail += f"; {self.outcome}"

    def wait(self, timeout: timedelta | None = None) -> str:
        """Block until the preemption finished; return its outcome."""
        if self._thread is not None:
            limit = timeout or (self.grace + self.settle + timedelta(seconds=1))
            self._thread.join(limit.total_seconds())
            if self._thread.is_alive():
                raise InjectionFailed(f"preemption of {self.pids} did not finish within {limit}")
        return self.outcome

    def _clear(self) -> None:
        self.wait()


# --------------------------------------------------------------------------
# etcd members
# --------------------------------------------------------------------------
class Member(Protocol):
    """What the etcd server wrapper offers (resilient/etcd/server.py)."""

    def stop(self) -> Any: ...
    def start(self) -> Any: ...


class EtcdMemberLoss(Injector):
    """Stop etcd members; restart them on clear.

    A member is a duck-typed object with ``stop()``/``start()`` (the etcd
    server wrapper), or a pid, killed with SIGKILL and restarted with
    ``restart(old_pid)`` if given, which returns the new pid (or member). ``probe(member) -> bool`` (is it serving?) verifies
    both directions when given; a member object with ``pid`` or ``is_running``
    is verified through that.
    """

    kind = "etcd-loss"

    def __init__(self, members: list[Member | int], *, restart: Callable[[int], Any] | None = None, probe: Callable[[Any], bool] | None = None, settle: timedelta = DEFAULT_SETTLE, **kw: Any) -> None:
        super().__init__(**kw)
        self.members, self.restart, self.probe, self.settle = list(members), restart, probe, settle
        self.pids: list[int] = []

    def _serving(self, m: Any) -> bool | None:
        if self.probe is not None:
            return bool(self.probe(m))
        if isinstance(m, int):
            try:
                return _alive(psutil.Process(m))
            except psutil.NoSuchProcess:
                return False
        if hasattr(m, "is_running"):
            return bool(m.is_running())
        pid = getattr(m, "pid", None)
        if isinstance(pid, int):
            try:
                return _alive(psutil.Process(pid))
            except psutil.NoSuchProcess:
                return False
        return None  # nothing to observe with: trust stop()/start()

    def _await(self, want: bool) -> list[Any]:
        deadline = time.monotonic() + self.settle.total_seconds()
        while True:
            wrong = [m for m in self.members if self._serving(m) not in (want, None)]
            if not wrong or time.monotonic() > deadline:
                return wrong
            time.sleep(0.05)

    def _inject(self) -> str:
        for m in self.members:
            if isinstance(m, int):
                self.pids.append(m)
                try:
                    os.kill(m, signal.SIGKILL)
                except ProcessLookupError:
                    raise InjectionFailed(f"etcd member pid {m} does not exist") from None
            else:
                m.stop()
        wrong = self._await(False)
        if wrong:
            raise InjectionFailed(f"etcd members {wrong} still serving after stop")
        return f"stopped {len(self.members)} etcd member(s)"

    def _clear(self) -> None:
        for i, m in enumerate(self.members):
            if isinstance(m, int):
                if self.restart is not None:
                    # The restarted member is a new process: watch that one.
                    new = self.restart(m)
                    self.members[i] = new if new is not None else m
            else:
                m.start()
        if any(not isinstance(m, int) for m in self.members) or self.restart is not None:
            wrong = self._await(True)
            if wrong:
                raise InjectionFailed(f"etcd members {wrong} not serving after restart")


class EtcdMemberKill(Injector):
    """``kill -9`` of one etcd member's process from outside (an OOM kill, a stray kill),
    verified undone by its watch (:meth:`resilient.etcd.server.EmbeddedEtcd.watch`, what
    ``resilient launch`` runs on the etcd it embeds): the member must serve again, as a new
    process on the same ports and data, within ``settle``. Instantaneous: nothing to clear."""

    kind = "embedded-etcd-kill"

    def __init__(self, member: Any, *, settle: timedelta = timedelta(seconds=15), **kw: Any) -> None:
        super().__init__(**kw)
        self.member, self.settle = member, settle

    def _inject(self) -> str:
        from resilient.etcd import EtcdError

        old = self.member.pid
        if old is None or not self.member.is_running():
            raise InjectionFailed(f"etcd member {self.member} is not running: nothing to kill")
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        deadline = t0 + self.settle.total_seconds()
        while time.monotonic() < deadline:
            new = self.member.pid
            if new not in (None, old):
                try:
                    with self.member.client(retry_timeout=timedelta(seconds=max(0.1, deadline - time.monotonic()))) as c:
                        c.check(timedelta(seconds=max(0.1, deadline - time.monotonic())))
                except EtcdError:
                    break
                return f"killed etcd member pid {old}; its watch restarted it as pid {new} in {time.monotonic() - t0:.1f} s"
            time.sleep(0.05)
        raise InjectionFailed(f"etcd member pid {old} was not serving again within {self.settle} of its kill "
                              "(is it watched? EmbeddedEtcd.watch)")


# --------------------------------------------------------------------------
# faults carried out inside the job (SDC hook, faulty fsspec): control files
# --------------------------------------------------------------------------
class ControlRequest(Injector):
    """Ask a consumer inside the job to inject (bit flips through the SDC
    hook, object-store faults through the faulty fsspec wrapper).

    Contract: the request is written atomically as
    ``CONTROL_DIR/<fault_id>.json`` = ``{"id", "kind", "target", "params"}``;
    the consumer acts on it and emits a ``fault_injected`` event carrying
    ``request = <fault_id>`` into any ``events.jsonl`` under ``run_dir``
    (:class:`~.control.ControlWatcher` is that consumer; ``status = "failed"``
    in the acknowledgement fails the injection at once).
    ``inject()`` waits for that acknowledgement (the observed effect) and
    raises :class:`InjectionFailed` when none comes within ``ack_timeout``.
    ``clear()`` removes the request and writes ``<fault_id>.clear``.
    """

    def __init__(self, kind: str, control_dir: str | os.PathLike, run_dir: str | os.PathLike, *, params: dict | None = None, ack_timeout: timedelta = timedelta(seconds=30), **kw: Any) -> None:
        super().__init__(**kw)
        self.kind = kind
        self.control_dir, self.run_dir = Path(control_dir), Path(run_dir)
        self.params, self.ack_timeout = dict(params or {}), ack_timeout
        self.ack: dict | None = None

    @property
    def request_path(self) -> Path:
        return self.control_dir / f"{self.fault_id}.json"

    def _find_ack(self, tail: EventTail) -> dict | None:
        for e in tail.poll():
            if e.get("event") == "fault_injected" and e.get("request") == self.fault_id:
                return e
        return None

    def _inject(self) -> str:
        self.control_dir.mkdir(parents=True, exist_ok=True)
        body = {"id": self.fault_id, "kind": self.kind, "target": self.target, "params": self.params}
        tmp = self.request_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.request_path)
        deadline = time.monotonic() + self.ack_timeout.total_seconds()
        tail = EventTail(self.run_dir)
        while time.monotonic() < deadline:
            self.ack = self._find_ack(tail)
            if self.ack is not None and self.ack.get("status") == "failed":
                self.request_path.unlink(missing_ok=True)
                raise InjectionFailed(f"{self.kind} request {self.fault_id} refused by node {self.ack.get('node')}: {self.ack.get('detail')}")
            if self.ack is not None:
                effect = f": {self.ack['effect']} on {self.ack.get('path', '?')}" if self.ack.get("effect") else ""
                return f"acknowledged by node {self.ack.get('node')} rank {self.ack.get('rank')}{effect}"
            time.sleep(0.05)
        self.request_path.unlink(missing_ok=True)
        raise InjectionFailed(f"no consumer acknowledged {self.kind} request {self.fault_id} in {self.ack_timeout} (is the job reading {self.control_dir}?)")

    def _clear(self) -> None:
        self.request_path.unlink(missing_ok=True)
        (self.control_dir / f"{self.fault_id}.clear").write_text("{}")


class Action(Injector):
    """A fault carried out by the runner's own callables (scale-down/up: stop
    or start an agent), with a ``check`` that observes its effect."""

    def __init__(self, kind: str, do: Callable[[], Any], check: Callable[[], bool], *, undo: Callable[[], Any] | None = None, settle: timedelta = DEFAULT_SETTLE, **kw: Any) -> None:
        super().__init__(**kw)
        self.kind, self.do, self.check, self.undo, self.settle = kind, do, check, undo, settle

    def _inject(self) -> str:
        result = self.do()
        deadline = time.monotonic() + self.settle.total_seconds()
        while not self.check():
            if time.monotonic() > deadline:
                raise InjectionFailed(f"{self.kind}: effect not observed within {self.settle}")
            time.sleep(0.05)
        return f"{self.kind} done" + (f": {result}" if result is not None else "")

    def _clear(self) -> None:
        if self.undo is not None:
            self.undo()
