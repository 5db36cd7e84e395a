"""The public API: every tier and check of the runtime for any PyTorch training loop.

    import resilient

    job = resilient.Job(model=model, optimizer=optimizer)
    for step in job.steps(total):
        loss = forward_backward(step)
        if not job.verify(loss, replay=lambda: forward_backward(step)):
            continue
        optimizer.step(); optimizer.zero_grad()

- :class:`Job`          restore, save, step boundary, preemption, SDC (:mod:`.job`);
  :class:`JobOptions` what a trainer that knows more tells it
- :class:`StateKeeper`  the tiers behind it, for loops that manage their own state (:mod:`resilient.snapshot.keeper`)
- :class:`ModelState`   module/optimizer pairs as snapshot state (:mod:`.modelstate`)
- :mod:`.api`           typed errors, the environment contract, ``Stateful``

This package, :mod:`resilient.runconfig` (the runtime's config sections),
:mod:`resilient.configbase` (typed config sections of your own) and
:mod:`resilient.errors` are the public surface: the built-in GPT
(:mod:`resilient.gpt`) uses nothing else of the runtime.
"""

from resilient.contract import said_peer_gone
from resilient.events import record_worker_error
from resilient.job.api import JobError, JobOptions, NotUnderAgent, Stateful
from resilient.job.job import Job, param_digest
from resilient.progress import Marks, device_peak_tflops
from resilient.snapshot.keeper import StateKeeper
from resilient.job.modelstate import ModelState
from resilient.sdc.reduction import pipeline_post_scale

__all__ = ["Job", "JobOptions", "JobError", "NotUnderAgent", "Stateful", "StateKeeper", "ModelState", "param_digest",
           # for a worker program of its own (the GPT's worker, resilient launch's script runner):
           # how its uncaught error reaches the agent, and the one error after a clean end that is none
           "record_worker_error", "said_peer_gone",
           # for trainers that know more (JobOptions): the phases timed before the Job
           # (JobOptions.startup), what a pipeline schedule does to the reduced gradients
           # (JobOptions.post_scale), a GPU's peak for the MFU a trainer reports
           "Marks", "pipeline_post_scale", "device_peak_tflops"]
