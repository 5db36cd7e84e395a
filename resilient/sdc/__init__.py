"""Silent data corruption: detection (checksums, linear reduction checks,
probes), replay verdicts, and bit-flip injection. See ``api`` for the types and
``monitor.SdcMonitor`` for the training-loop hooks."""

from resilient.sdc.api import (Action, Decision, SdcConfig, SdcDetected, SdcError, Suspicion,  # noqa: F401
                               Verdict)

__all__ = ["Action", "Decision", "SdcConfig", "SdcDetected", "SdcError", "Suspicion", "Verdict"]
