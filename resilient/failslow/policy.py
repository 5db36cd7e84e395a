"""What a straggler verdict costs, and whether acting on it pays.

The cost model compares two measured quantities, in seconds of the whole job:

- what the straggler costs if left alone: every step takes ``factor`` times what
  it would, so each remaining step loses ``step_seconds * (1 - 1/factor)``;
  over the ``remaining_steps`` that is ``expected_loss_seconds``;
- what acting costs: one re-form (the slow node's workers leave, a spare takes
  the seat or the job shrinks, everyone restores from RAM), ``reform_seconds``,
  measured (a worker's own time from its process start to its first step) or set.

Acting pays when the expected loss exceeds the re-form cost (and at least
``min_remaining_steps`` are left; never for a link, which replacing a node does
not fix). The decision and its arithmetic are fields of the ``straggler``
event; the ``report`` policy (the only one so far) never acts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from resilient.failslow.api import FailSlowConfig, Straggler


@dataclass
class Decision:
    policy: str
    action: str                    # "report" (no action) or "replace"
    pays: bool                     # acting would pay, by the arithmetic below
    step_seconds: float
    remaining_steps: int | None    # None: the run's length is unknown (then acting never pays)
    loss_per_step_seconds: float
    expected_loss_seconds: float | None
    reform_seconds: float
    reason: str

    def fields(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def decide(cfg: FailSlowConfig, s: Straggler, *, step_seconds: float, remaining_steps: int | None,
           reform_seconds: float) -> Decision:
    loss = step_seconds * (1.0 - 1.0 / max(1.0, s.factor))
    expected = loss * remaining_steps if remaining_steps is not None else None
    if expected is None:
        pays, reason = False, "the run's length is unknown: the remaining loss cannot be weighed"
    elif remaining_steps < cfg.min_remaining_steps:
        pays, reason = False, f"{remaining_steps} steps left < min_remaining_steps {cfg.min_remaining_steps}"
    elif expected > reform_seconds:
        pays, reason = True, f"losing {expected:.1f} s over {remaining_steps} steps > a re-form's {reform_seconds:.1f} s"
    else:
        pays, reason = False, f"losing {expected:.1f} s over {remaining_steps} steps ≤ a re-form's {reform_seconds:.1f} s"
    if pays and s.cause == "link":
        pays, reason = False, reason + "; but a slow link is not fixed by replacing a node"
    elif pays:
        reason += f"; policy {cfg.policy!r} reports only"
    return Decision(cfg.policy, "report", pays, step_seconds, remaining_steps, loss, expected, reform_seconds, reason)
