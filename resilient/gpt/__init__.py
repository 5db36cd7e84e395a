"""The built-in GPT trainer: the public API's first user.

A decoder-only GPT (RMSNorm, RoPE, SwiGLU, SDPA attention) trained with 3D
parallelism — FSDP2 (ZeRO-2/3) × DTensor tensor parallel × pipelining — on a
byte-level corpus addressed by global sample index. Everything that outlives a
step (snapshots in every tier, restore with resharding, SDC checks, heartbeats,
preemption) comes from :class:`resilient.Job`, exactly as for a user's script:
this package imports the public API (``resilient.job``, ``resilient.runconfig``,
``resilient.configbase``, ``resilient.errors``) and torch, nothing else of the
runtime, and nothing in the runtime imports it (``tests/unit/project/test_layers.py``).

- :mod:`.config`    the run config: [model], [parallel], [train], [data] + the runtime's sections
- :mod:`.model`     the GPT
- :mod:`.parallel`  the (pp, dp, tp) mesh: FSDP2, DTensor TP, pipelining
- :mod:`.data`      token corpora (memmap) addressed by global sample index
- :mod:`.optim`     AdamW, the learning-rate schedule, global gradient clipping
- :mod:`.train`     the training loop (one orchestrator)
- :mod:`.worker`    ``python -m resilient.gpt.worker``: one worker process
- :mod:`.program`   how ``resilient launch CONFIG.toml`` starts the GPT's workers
"""
