"""Silent data corruption (SDC): detection, replay verdicts, probes, injection.

Modules, by role:

* ``api``        - errors, :class:`Verdict`, :class:`Suspicion`, :class:`Decision`, ``[sdc]`` config
* ``checksums``  - per-tensor (sum, L1, amax, bit-sum) rows; replica comparison; robust spikes
* ``reduction``  - the linear check of FSDP2 reduce-scatters and of DDP-style all-reduces
* ``replay``     - fingerprints and the replay state machine
* ``probes``     - known-answer arithmetic tests (:class:`~resilient.sdc.probes.Prober`)
* ``inject``     - bit flips in gradients, parameters, optimizer state, activations
* ``monitor``    - :class:`~resilient.sdc.monitor.SdcMonitor`, the training loop's hooks
* ``harness``    - a pool of gloo workers for tests, benches and chaos experiments

Coverage in one line each (details in the module docstrings):
reduced FSDP2 gradient shards (linear check, one step); replicated gradients and
parameters (bitwise, one step); parameters at rest between optimizer steps
(bit-sum, next step); non-finite values (at their source rank); exponent-size
corruption *before* a reduction (per-rank L1 spike, after warm-up); wrong
arithmetic on a device (probes). Not covered: a wrong but finite, ordinary-size
gradient computed by backward before the reduction, and a wrong optimizer
update of a sharded (non-replicated) parameter.
"""

from resilient.sdc.api import (Action, Decision, SdcConfig, SdcDetected, SdcError, Suspicion,  # noqa: F401
                               Verdict)

__all__ = ["Action", "Decision", "SdcConfig", "SdcDetected", "SdcError", "Suspicion", "Verdict"]
