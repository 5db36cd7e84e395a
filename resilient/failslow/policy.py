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
not fix). Under the ``replace`` policy the job acts on a verdict that pays when
there is a seat to hand over (``seat``: a warm spare waits, or the job may
shrink above its minimum nodes): the slow node leaves (:mod:`~.replace`). The
decision and its arithmetic are fields of the ``straggler`` event.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from resilient.failslow.api import FailSlowConfig, Straggler

# What :func:`decide` is told about the seat the slow node would leave (resilient.failslow.replace)
SEATS = {"spare": "a warm spare takes the seat", "shrink": "the job shrinks (no spare; above its minimum nodes)"}
NO_SEAT = {None: "not under `resilient launch`: no agent to take the node out",
           "none": "no warm spare, and the job is at its minimum nodes: nobody would take the seat"}


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
    seat: str | None = None        # replace: spare | shrink | none (None: not asked)

    def fields(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def pays(cfg: FailSlowConfig, s: Straggler, *, step_seconds: float, remaining_steps: int | None,
         reform_seconds: float) -> Decision:
    """The arithmetic alone (action ``report``): would replacing the slow node pay?"""
    loss = step_seconds * (1.0 - 1.0 / max(1.0, s.factor))
    expected = loss * remaining_steps if remaining_steps is not None else None
    if expected is None:
        ok, reason = False, "the run's length is unknown: the remaining loss cannot be weighed"
    elif remaining_steps < cfg.min_remaining_steps:
        ok, reason = False, f"{remaining_steps} steps left < min_remaining_steps {cfg.min_remaining_steps}"
    elif expected > reform_seconds:
        ok, reason = True, f"losing {expected:.1f} s over {remaining_steps} steps > a re-form's {reform_seconds:.1f} s"
    else:
        ok, reason = False, f"losing {expected:.1f} s over {remaining_steps} steps ≤ a re-form's {reform_seconds:.1f} s"
    if ok and s.cause == "link":
        ok, reason = False, reason + "; but a slow link is not fixed by replacing a node"
    return Decision(cfg.policy, "report", ok, step_seconds, remaining_steps, loss, expected, reform_seconds, reason)


def decide(cfg: FailSlowConfig, s: Straggler, *, step_seconds: float, remaining_steps: int | None,
           reform_seconds: float, seat: str | None = None) -> Decision:
    """:func:`pays`, then the policy: ``replace`` acts on a verdict that pays when ``seat``
    says someone takes it (``spare``, ``shrink``; ``none`` or None: nobody)."""
    d = pays(cfg, s, step_seconds=step_seconds, remaining_steps=remaining_steps, reform_seconds=reform_seconds)
    if not d.pays:
        return d
    if cfg.policy == "report":
        d.reason += "; policy 'report' reports only"
    elif seat in SEATS:
        d.action, d.seat = "replace", seat
        d.reason += f"; node {s.slow_node} leaves: {SEATS[seat]}"
    else:
        d.seat = seat
        d.reason += f"; not replaced: {NO_SEAT.get(seat, seat)}"
    return d
