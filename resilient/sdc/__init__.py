"""Silent data corruption (SDC): detection, replay verdicts, probes, injection.

Modules, by role:

* ``api``        - errors, :class:`Verdict`, :class:`Suspicion`, :class:`Decision`, ``[sdc]`` config
* ``checksums``  - per-tensor (sum, L1, amax, bit-sum) rows; replica comparison; robust spikes
* ``native``     - the same checksums in one pass per tensor on CPU (``native.c``, built on first use)
* ``atrest``     - bit-sum records of parameters and optimizer state between optimizer steps
* ``reduction``  - the linear check of FSDP2 reduce-scatters and of DDP-style all-reduces
* ``abft``       - checksummed GEMMs of ``nn.Linear`` layers (forward, grad-input, grad-weight)
* ``activations``- range checks of each block's output against its own history
* ``replay``     - fingerprints and the replay state machine
* ``probes``     - known-answer arithmetic tests (:class:`~resilient.sdc.probes.Prober`)
* ``inject``     - bit flips in gradients, parameters, optimizer state, activations
* ``monitor``    - :class:`~resilient.sdc.monitor.SdcMonitor`, the training loop's hooks
* ``harness``    - a pool of gloo workers for tests, benches and chaos experiments

Coverage in one line each (details in the module docstrings):
reduced FSDP2 gradient shards (linear check of the collective, one step; any
change after the collective, exactly, by the bit-sum of its output); replicated
gradients and parameters (bitwise, one step); parameters and optimizer state at
rest between optimizer steps (bit-sums, caught before the next optimizer step);
non-finite values (at their source rank); exponent-size corruption *before* a
reduction (per-rank L1 spike, after warm-up); wrong arithmetic on a device
(probes); a wrong result of any ``nn.Linear`` GEMM, forward or backward, beyond
its rounding bound (checksums, in the step); an exponent-size excursion of a
block's output (range check, in the step). Not covered: a wrong but
ordinary-size result of compute outside Linear layers (attention's SDPA
matmuls, softmax, norms, convolutions, embeddings) before the reduction (it
enters the reduction as if it were right, and no replica holds the same batch),
and a wrong optimizer update of a sharded (non-replicated) parameter.
"""

from resilient.sdc.api import (Action, Decision, SdcConfig, SdcDetected, SdcError, Suspicion,  # noqa: F401
                               Verdict)

__all__ = ["Action", "Decision", "SdcConfig", "SdcDetected", "SdcError", "Suspicion", "Verdict"]
