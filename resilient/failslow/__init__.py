"""Fail-slow: find the slow device, host or link within a few steps, name it, weigh acting.

- :mod:`~resilient.failslow.api`: ``[failslow]`` knobs, the :class:`Straggler` verdict
- :mod:`~resilient.failslow.timing`: per-rank step phases (compute, wait, data, snapshot)
- :mod:`~resilient.failslow.detector`: robust scores across ranks and against each rank's history
- :mod:`~resilient.failslow.policy`: the cost model (act only when acting pays)
- :mod:`~resilient.failslow.monitor`: the step boundary: the stop flag, rank 0's verdicts acted on by every rank
- :mod:`~resilient.failslow.courier`: each rank's timings gathered on rank 0 and judged there, on a thread
- :mod:`~resilient.failslow.replace`: the ranks' end of the ``replace`` policy (the agent's: :mod:`resilient.agent.seats`)
"""

from resilient.failslow.api import CAUSES, PHASES, FailSlowConfig, FailSlowError, Straggler
from resilient.failslow.detector import Detector

__all__ = ["CAUSES", "PHASES", "FailSlowConfig", "FailSlowError", "Straggler", "Detector"]
