"""A PyTorch Lightning script with every tier of resilient: one callback.

The small transformer and data set of the other examples (``toy.py``), trained by a
``LightningModule`` with AdamW and a per-step LR schedule. The lines resilient adds are
marked ``# resilient``::

    python examples/lightning_train.py --steps 50     # the durable tier in runs/lightning_train
    resilient launch --nproc-per-node 2 examples/lightning_train.py --steps 200   # + node RAM, peers

Kill it and start it again: it resumes from the newest committed version (weights,
optimizer, LR schedule, Lightning's step and epoch, the data's position, the RNGs) and
ends bitwise equal to a run that was never killed. SIGTERM (a preemption) saves the step
in flight and ends the fit. Under ``resilient launch`` (or ``torchrun``) Lightning reads
the launcher's environment (``RANK``, ``LOCAL_WORLD_SIZE``, ...) and runs DDP on it.

Exact resume mid-epoch needs a data loader with ``state_dict()``/``load_state_dict()``
(Lightning saves its position; torchdata's ``StatefulDataLoader`` is one): here
:class:`SampleBatches`, over the examples' resumable sampler.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from toy import VOCAB, ResumableSampler, TinyTransformer, arguments, batch_for

try:
    import lightning.pytorch as L
except ImportError:
    import pytorch_lightning as L

from resilient.integrations.lightning import ResilientCallback  # resilient


class SampleBatches:
    """This rank's share of each global batch, ``batches_per_epoch`` batches an epoch. A sized
    iterable (Lightning then fetches no batch ahead, so the saved position is the trained one)
    with ``state_dict()``: the sampler's position, saved with Lightning's loop progress."""

    def __init__(self, sampler: ResumableSampler, global_batch: int, seed: int, batches_per_epoch: int,
                 rank: int = 0, world: int = 1):
        self.sampler, self.global_batch, self.seed, self.batches = sampler, global_batch, seed, batches_per_epoch
        self.local = global_batch // world
        self.rank = rank

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for _ in range(self.batches):
            ids = self.sampler.next_batch(self.global_batch)[self.rank * self.local:(self.rank + 1) * self.local]
            yield batch_for(ids, self.seed)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class TinyLM(L.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup: int = 10, pace: float = 0.0):
        super().__init__()
        self.model = TinyTransformer()
        self.lr, self.warmup, self.pace = lr, warmup, pace

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.pace:
            time.sleep(self.pace)   # time to kill it mid-run
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def trainer_for(steps: int, callbacks: list, **kwargs) -> L.Trainer:
    """A Trainer on the launcher's processes: ``devices``/``num_nodes`` from torchrun's
    environment, so the same script runs under ``python``, ``torchrun`` and ``resilient launch``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return L.Trainer(max_steps=steps, accelerator="cpu" if not torch.cuda.is_available() else "auto",
                     devices=local, num_nodes=max(1, world // local), strategy="ddp" if world > 1 else "auto",
                     callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, **kwargs)


def main() -> None:
    args = arguments()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    L.seed_everything(args.seed, verbose=False)
    data = SampleBatches(ResumableSampler(args.dataset_size, args.seed), args.global_batch, args.seed,
                         batches_per_epoch=args.dataset_size // args.global_batch, rank=rank, world=world)
    trainer = trainer_for(args.steps, [ResilientCallback()])                        # resilient
    trainer.fit(TinyLM(args.lr, pace=args.pace), train_dataloaders=data)


if __name__ == "__main__":
    main()
