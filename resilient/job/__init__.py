"""The public API: every tier and check of the runtime for any PyTorch training loop.

    import resilient

    job = resilient.Job(model=model, optimizer=optimizer)
    for step in job.steps(total):
        loss = forward_backward(step)
        if not job.verify(loss, replay=lambda: forward_backward(step)):
            continue
        optimizer.step(); optimizer.zero_grad()

- :class:`Job`          restore, save, step boundary, preemption, SDC (:mod:`.job`)
- :class:`StateKeeper`  the tiers behind it, for loops that manage their own state (:mod:`.keeper`)
- :class:`ModelState`   module/optimizer pairs as snapshot state (:mod:`.modelstate`)
- :mod:`.api`           typed errors, the environment contract, ``Stateful``
"""

from resilient.job.api import JobError, NotUnderAgent, Stateful
from resilient.job.job import Job, param_digest
from resilient.job.keeper import StateKeeper
from resilient.job.modelstate import ModelState

__all__ = ["Job", "JobError", "NotUnderAgent", "Stateful", "StateKeeper", "ModelState", "param_digest"]
