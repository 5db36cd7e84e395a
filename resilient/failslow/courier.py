"""Each rank's timings carried to rank 0, and judged there, on a thread beside the loop.

The step boundary only hands this rank's six numbers to :class:`Courier`
(a queue put). Its thread sends them to rank 0 in a gather on a gloo group of
its own (the boundary's stop flag keeps its group: collectives issued from two
threads on one group would not keep the same order on every rank), and on rank 0
feeds the gathered matrix to the :class:`~resilient.failslow.detector.Detector`.
Neither the gather's launch (~60-90 µs with gloo on a loaded host) nor the
detector (~10 µs per rank in Python: 43 µs at 4 ranks, 10 ms at 1,024) is on
the training thread, which every rank of a large job would otherwise wait for at
the next collective.

A verdict names the step whose timings showed it; the boundary collects it with
:meth:`Courier.take` and every rank acts on it together at the first boundary
after the judging (monitor.py), usually one or two steps later.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from resilient.failslow.detector import Detector

log = logging.getLogger(__name__)
_STOP = object()
# At a normal close the gathers still queued are finished first (every rank closes after the
# same step and sends the same ones): a process that exits while its courier is blocked in a
# gloo gather aborts (SIGABRT), which its agent would count as a failure. A peer that left
# early is not waited for longer than this.
CLOSE_WAIT = timedelta(seconds=2)
# More exchanges queued than this: the courier (the gather, and on rank 0 the detector: ~10 µs
# per rank) is slower than the steps; the verdicts lag further each step.
BACKLOG_WARN = 64
LINK = -1   # Courier.retry's name for the link signal


class Courier:
    """``group``: the gloo group the timings travel on (its own); ``detector``: rank 0's."""

    def __init__(self, group: Any, rank: int, world: int, width: int, detector: Detector | None = None,
                 trace: str | os.PathLike | None = None):
        """``trace``: rank 0 appends the detector's state after every observation there
        (JSON lines: ``time``, ``step``, :meth:`Detector.state`, ``verdicts`` as causes)."""
        import torch.distributed as dist

        self.group, self.rank, self.world, self.width = group, rank, world, width
        self.root = dist.get_global_rank(group, 0)
        self.detector = detector
        self.history: list | None = None   # a list to keep every (step, matrix) in (rank 0; the bench)
        self._trace = open(trace, "a", buffering=1) if trace is not None and detector is not None else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Condition()   # the detector's state (held from the training thread), the counts
        self._found: dict | None = None
        self._pending = 0
        self._rearm: dict[int, int] = {}   # rank (LINK: the link) -> observations until its verdict is forgotten
        self.error: BaseException | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="resilient-failslow-courier", daemon=True)
        self._thread.start()

    def submit(self, step: int, numbers: list[float]) -> None:
        """This rank's timings of the interval that ended at ``step`` (every rank, same steps)."""
        if self.error is not None:
            return   # the thread is gone (a peer left): nothing would carry them
        with self._lock:
            self._pending += 1
            backlog = self._pending
        self._inbox.put((step, numbers))
        if backlog > BACKLOG_WARN and not self._warned:
            self._warned = True
            log.warning("fail-slow: %d timing exchanges queued on rank %d; judging %d ranks is slower than "
                        "the steps: raise failslow.every", backlog, self.rank, self.world)

    def take(self) -> dict | None:
        """Rank 0: what was found since the last call: {"rows": the matrix of the last verdict,
        "verdicts": [Straggler fields...], "raised": ranks the detector holds judged now}, or
        None. Never waits for the judging under way (the training thread calls it): what it
        finds comes at the next call."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            found, self._found = self._found, None
            if found is not None:
                found["raised"] = [r for r, sig in enumerate(self.detector.ranks) if sig.raised]
            return found
        finally:
            self._lock.release()

    def hold(self, ranks: list[int]) -> None:
        """Rank 0: the probe named ``ranks``: the timing signal must not name them again, nor
        may a verdict on them found meanwhile (judged while the probe ran) be acted on twice."""
        if self.detector is not None:
            with self._lock:
                self.detector.hold(ranks)
                if self._found is not None:
                    held = set(ranks)
                    self._found["verdicts"] = [v for v in self._found["verdicts"] if not set(v["slow_ranks"]) <= held]
                    if not self._found["verdicts"]:
                        self._found = None

    def retry(self, ranks: list[int], after: int) -> None:
        """Rank 0: forget the verdict on ``ranks`` (:data:`LINK`: the link's) after ``after``
        more observations, so that a slowdown still there is judged (and weighed) again."""
        if self.detector is not None:
            with self._lock:
                for r in ranks:
                    self._rearm[r] = after

    def drain(self, timeout: timedelta = timedelta(seconds=30)) -> bool:
        """Wait until everything submitted was sent (and judged); False if ``timeout`` ran out."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout.total_seconds())

    def close(self, failed: bool = False) -> None:
        """``failed``: the process is failing; its peers may be gone: the queue is not finished."""
        if not failed and self.error is None:
            self.drain(CLOSE_WAIT)
        self._inbox.put(_STOP)
        self._thread.join(timeout=CLOSE_WAIT.total_seconds())
        if self._trace is not None:
            with self._lock:
                self._trace.close()
                self._trace = None

    def _run(self) -> None:
        import torch
        import torch.distributed as dist

        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            step, numbers = item
            try:
                mine = torch.tensor(numbers, dtype=torch.float64)
                slots = [torch.zeros(self.width, dtype=torch.float64) for _ in range(self.world)] \
                    if self.detector is not None else None
                dist.gather(mine, slots, dst=self.root, group=self.group)
                if slots is not None:
                    self._judge(step, [slot.tolist() for slot in slots])
            except Exception as e:   # a peer gone (the job ends or re-forms): nothing more to carry
                self.error = e
                log.info("fail-slow timings no longer gathered on rank %d: %s", self.rank, e)
                return
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _judge(self, step: int, rows: list[list[float]]) -> None:
        with self._lock:
            if self.history is not None:
                self.history.append((step, rows))
            for r in list(self._rearm):
                self._rearm[r] -= 1
                if self._rearm[r] <= 0:
                    del self._rearm[r]
                    if r == LINK:
                        self.detector.rearm_link()
                    else:
                        self.detector.rearm([r])
            verdicts = self.detector.observe(step, rows)
            if self._trace is not None:
                self._trace.write(json.dumps({"time": round(time.time(), 3), "step": step, **self.detector.state(),
                                              "verdicts": [v.cause for v in verdicts]}) + "\n")
            if verdicts:
                found = self._found or {"verdicts": []}
                found["rows"] = rows
                found["verdicts"] = found["verdicts"] + [asdict(v) for v in verdicts]
                self._found = found
