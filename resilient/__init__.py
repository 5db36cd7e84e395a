"""resilient: a fault-tolerant, elastic training runtime for PyTorch.

Subpackages, each with an ``api.py`` of abstract types and typed errors where
it has a contract with the others:

- :mod:`resilient.job`        the public API: ``resilient.Job`` gives any training loop every tier and check
- :mod:`resilient.gpt.config`     run configs (TOML → typed dataclasses)
- :mod:`resilient.gpt.data`       token corpora (memmap) addressed by global sample index
- :mod:`resilient.gpt.model`      the GPT (RMSNorm, RoPE, SwiGLU, SDPA)
- :mod:`resilient.gpt.parallel`   (pp, dp, tp) mesh: FSDP2, DTensor TP, pipelining
- :mod:`resilient.gpt.train`      the worker's training loop
- :mod:`resilient.launch`     ``resilient launch``: runs the job
- :mod:`resilient.events`     the JSON-lines event log every process writes
"""

__version__ = "0.1.0"

__all__ = ["Job", "JobOptions"]


def __getattr__(name: str):
    # ``resilient.Job`` without importing torch for every ``import resilient`` (the CLI's start).
    if name in ("Job", "JobOptions"):
        import resilient.job

        return getattr(resilient.job, name)
    raise AttributeError(f"module 'resilient' has no attribute {name!r}")
