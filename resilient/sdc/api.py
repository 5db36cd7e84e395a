"""Typed API of silent-data-corruption (SDC) detection.

Hardware that computes a wrong answer without crashing is measured, not
hypothetical (Meta: ~1 in 1000 machines; Llama 3: 6 of 419 interruptions). The
training loop sees it only as numbers that are slightly, or wildly, off. This
module holds the vocabulary the rest of :mod:`resilient.sdc` speaks: the errors,
what a check *suspects* (:class:`Suspicion`), what a replay *concludes*
(:class:`Verdict`), what the loop should *do* (:class:`Decision`), and the
``[sdc]`` config section (:class:`SdcConfig`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from resilient.configbase import check_bounds, knob
from resilient.errors import ConfigError, ResilientError


class SdcError(ResilientError):
    """A misuse of the SDC machinery (an unsupported layout, a bad injection spec).

    The message names the unsupported setting and what to change.
    """


class SdcDetected(SdcError):
    """A confirmed corruption the caller chose to treat as fatal.

    Raised by :meth:`SdcMonitor.raise_if_fatal` for a PERSISTENT verdict when the
    loop cannot roll back itself (a library user without snapshots): restart from
    the last checkpoint without ``rank`` / ``device``.
    """

    def __init__(self, rank: int, device: str, kind: str, step: int, detail: str = ""):
        self.rank, self.device, self.kind, self.step = rank, device, kind, step
        super().__init__(
            f"silent data corruption on rank {rank} ({device}): {kind} at step {step}"
            f"{'; ' + detail if detail else ''}. Restart from the last clean checkpoint "
            f"without this device, and run `resilient` probes on it before reuse."
        )


class Verdict(enum.Enum):
    """What a replay of a suspect step concludes about one rank.

    Transitions (``SUSPECT`` is the state a check puts a rank in; the replay
    recomputes the step from the pre-step state on the same device and compares
    the rank's fingerprint ``F`` of the suspect tensors, original vs replayed):

    * ``F_replay == F_orig`` and the checks pass on the replay → ``FALSE_ALARM``:
      the answer is reproducible and agrees with the majority / the linear
      invariant; the suspicion came from a heuristic (e.g. a data-driven loss
      spike). Training continues with the (identical) result.
    * ``F_replay == F_orig`` and the checks fail again → ``PERSISTENT``: the
      device gives the same wrong answer twice; it is bad. Roll back, quarantine.
    * ``F_replay != F_orig`` and the checks fail again → ``PERSISTENT`` as well
      (a different wrong answer: a flaky device that is still wrong).
    * ``F_replay != F_orig``, checks pass, and the difference is beyond rounding
      → ``TRANSIENT``: a one-off fault; the replayed result replaces the bad one
      (no rollback needed when the fault was caught before the optimizer step).
      ``max_transients`` transients on one device escalate to ``PERSISTENT``.
    * ``F_replay != F_orig`` but within the rounding bound of the computation
      → ``HARMLESS``: a flip too small to change anything beyond rounding.
      Also given without replay to a mismatch whose size is within rounding.

    A reproducible answer (``F_replay == F_orig``) is also put to the device's
    known-answer probes: a failing probe makes it ``PERSISTENT`` whatever the
    checks said; a passing one turns a reproducible *heuristic* suspicion
    (non-finite, spike) into ``FALSE_ALARM`` (training instability, not SDC),
    and singles out the bad one of two tied replicas. Faults found after they
    reached the parameters (at rest, replica parameters) cannot be replayed:
    they are ``TRANSIENT`` with a rollback, escalated like any transient.
    """

    FALSE_ALARM = "false_alarm"
    TRANSIENT = "transient"
    PERSISTENT = "persistent"
    HARMLESS = "harmless"


class Action(enum.Enum):
    """What the training loop must do after an SDC hook (the same on every rank)."""

    CONTINUE = "continue"      # nothing wrong, or harmless / false alarm / healed by replay
    REPLAY = "replay"          # zero grads, recompute this step's forward+backward, call after_replay
    ROLLBACK = "rollback"      # restore the last clean snapshot version on every rank
    QUARANTINE = "quarantine"  # roll back and quarantine ``Decision.quarantine`` ranks


# Kinds of suspicion, by the check that raises them.
KIND_REDUCTION = "reduction_mismatch"   # linear check: sum in != sum out of a reduction
KIND_REPLICA = "replica_mismatch"       # replicas that must be bitwise equal are not
KIND_AT_REST = "param_at_rest"          # a parameter changed between optimizer step and use
KIND_STATE_AT_REST = "optim_state_at_rest"   # optimizer state (Adam moments, step) changed between two steps
KIND_GRAD_AT_REST = "grad_at_rest"      # a reduced gradient changed between its reduction and the check
KIND_NONFINITE = "nonfinite"            # NaN/inf in loss or gradients
KIND_LOSS_SPIKE = "loss_spike"          # loss beyond median + k·MAD of its window
KIND_GRAD_SPIKE = "grad_spike"          # a rank's pre-reduction gradient L1 beyond its window
KIND_PROBE = "probe_failure"            # a known-answer test gave a wrong answer
KIND_GEMM = "gemm_mismatch"             # a Linear's GEMM (forward, grad-input, grad-weight) broke its checksum identity
KIND_ACTIVATION_SPIKE = "activation_spike"   # a block's output amax beyond its own window (exponent-size excursion)
KIND_CROSS = "cross_check_mismatch"     # a rank's forward recomputed on another device gave another answer


@dataclass
class Suspicion:
    """One check's claim that ``rank`` holds a wrong value at ``step``.

    ``evidence`` is JSON-able: the numbers that tripped the check and the bound
    they were held to, so the event log alone explains the decision.
    ``harmless`` is set when the measured discrepancy is within what rounding
    can produce (the mismatch is real, bitwise, but cannot matter).
    """

    step: int
    rank: int
    kind: str
    tensor: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    harmless: bool = False

    def as_event(self) -> dict[str, Any]:
        return {"step": self.step, "suspect_rank": self.rank, "kind": self.kind,
                "tensor": self.tensor, "device": self.device, "harmless": self.harmless,
                "evidence": self.evidence}


@dataclass
class Spent:
    """Time spent in SDC code: wall-clock and process-CPU seconds.

    Both, because on a shared machine wall time also counts the waits for a
    core that other processes hold; CPU time (all threads of the process, so a
    collective's helper threads count too) is what the checks themselves cost.
    """

    wall: float = 0.0
    cpu: float = 0.0

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def since(self, start: tuple[float, float]) -> None:
        """Add the time from ``start`` (a :meth:`now`) to now."""
        w, c = Spent.now()
        self.wall += w - start[0]
        self.cpu += c - start[1]


@dataclass
class Decision:
    """The agreed outcome of one hook: identical on every rank of the world."""

    action: Action = Action.CONTINUE
    suspicions: list[Suspicion] = field(default_factory=list)
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # rank -> verdict
    quarantine: list[int] = field(default_factory=list)          # ranks to quarantine
    devices: dict[int, str] = field(default_factory=dict)        # rank -> device id
    rollback_to: int | None = None  # newest step whose state checks verified clean (-1: the initial state)

    @property
    def ok(self) -> bool:
        return self.action is Action.CONTINUE


PROBE_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass
class SdcConfig:
    """The ``[sdc]`` section: silent-data-corruption checks, replay and probes."""

    enable: bool = knob(True, "run the SDC checks at all; off = zero overhead and no detection")
    check_every: int = knob(1, "run the gradient checks (linear reduction check, replicas, non-finite, spikes) every N steps")
    param_check_every: int = knob(1, "verify parameters at rest (hash after the step, checked before the next forward) and across replicas every N steps; 0 disables")
    state_check_every: int = knob(1, "verify the watched optimizer's state at rest (hash after the step, checked before the next one) every N steps; a flip between two unchecked steps goes unseen; 0 disables")
    loss_spike_k: float = knob(12.0, "a loss above median + k·MAD·1.4826 of the recent window is a suspicion (robust z-score); 0 disables")
    grad_spike_k: float = knob(50.0, "a rank's pre-reduction gradient L1 (log scale) beyond median + k·MAD of its window is a suspicion; 0 disables")
    spike_window: int = knob(50, "steps of history the loss / gradient spike detectors keep")
    spike_warmup: int = knob(10, "steps of history needed before spikes are judged")
    bound_safety: float = knob(2.0, "multiply the derived worst-case rounding bound of the linear check by this (covers fused/blocked kernels whose op count exceeds the model)")
    abft_every: int = knob(0, "check every nn.Linear GEMM (forward, grad-input, grad-weight) against its row-checksum identity, within the rounding bound of its dtype and sizes (resilient.sdc.abft): N = every N-th step (1 catches every fault in its step); 0 = on the steps sdc.abft_budget samples (the default: a persistent fault in any Linear's forward or backward is found within sdc.abft_max_period steps); set both to 0 to disable")
    abft_budget: float = knob(0.01, "with abft_every = 0, the GEMM checks run every N-th step, N chosen so they cost at most this fraction of step time: a checked step costs ~1.3x a plain one on CPU at the demo's size (python bench/sdc_compute.py --only gemms), re-measured at each sample and agreed over ranks; the period in force is printed at start; 0 disables")
    abft_max_period: int = knob(50, "at most this many steps between sampled GEMM checks, whatever the budget: a persistent fault in a Linear's forward or backward is found within this many steps")
    activation_every: int = knob(0, "hold each block's output amax (and its direct children's) against its own history every N steps (resilient.sdc.activations); 0 disables. Off by default: +27% of a demo step's CPU on CPU (python bench/sdc_compute.py --only activations)")
    activation_spike_k: float = knob(50.0, "a block output's log(amax) beyond median ± k·MAD of its window (a rise or a drop) is a suspicion (an exponent-size excursion either way); 0 disables the spike test, non-finite outputs are still caught")
    cross_check_budget: float = knob(0.01, "sampled cross-device replay: every rank's forward is recomputed bitwise by its neighbour rank at a period chosen so the recomputes cost at most this fraction of step time (measured at each sample; the period in force is printed at start); 0 disables (resilient.sdc.crosscheck)")
    cross_check_max_period: int = knob(50, "at most this many steps between cross-device replays, whatever the budget: a persistent fault on any rank is found within this many steps")
    replay: bool = knob(True, "recompute a suspect step before deciding; off = roll back on any non-harmless suspicion")
    max_transients: int = knob(3, "transient faults on one device before it is treated as persistent")
    probe_every: float = knob(0.0, "seconds between background arithmetic probes on this device; 0 = only on demand")
    probe_matmul: int = knob(256, "side of the square matrices of the matmul probe")
    probe_reduce: int = knob(1 << 20, "elements of the reduction probe")
    probe_dtypes: tuple[str, ...] = knob(("float32", "bfloat16"), "dtypes the probes test (the ones training uses)")
    probe_seed: int = knob(1234, "seed of the probe inputs (known answers are recomputed from it)")
    inject: tuple[dict, ...] = knob((), "bit flips to inject, for tests and drills: tables of resilient.sdc.inject.FlipSpec fields, e.g. {target = 'grad', tensor = 'layers.0.attention.wq.weight', bit = 30, rank = 1, step = 5}; node = 'b' (and local_rank) instead of rank pins a bad device, which keeps its fault whatever rank it gets")

    def __post_init__(self) -> None:
        """Refuse values that would silently disable a check or break one (a window of 0,
        a safety factor that shrinks the bound below the rounding it must admit)."""
        at_least = {"check_every": 0, "param_check_every": 0, "state_check_every": 0, "loss_spike_k": 0,
                    "grad_spike_k": 0, "abft_every": 0, "activation_every": 0, "activation_spike_k": 0, "spike_window": 1, "spike_warmup": 0, "bound_safety": 1,
                    "max_transients": 1, "probe_every": 0, "probe_matmul": 1, "probe_reduce": 1,
                    "cross_check_budget": 0, "cross_check_max_period": 1,
                    "abft_budget": 0, "abft_max_period": 1}
        check_bounds(self, "sdc", at_least=at_least)
        if self.spike_warmup > self.spike_window:
            raise ConfigError(f"'sdc.spike_warmup' ({self.spike_warmup}) must not exceed 'sdc.spike_window' "
                              f"({self.spike_window}): spikes would never be judged")
        for name in self.probe_dtypes:
            if name not in PROBE_DTYPES:
                raise ConfigError(f"'sdc.probe_dtypes': {name!r} is not a floating-point torch dtype "
                                  f"({', '.join(PROBE_DTYPES)})")
