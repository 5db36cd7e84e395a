"""What the example scripts share: a small transformer, a synthetic data set addressed
by global sample index, and a resumable sampler. Nothing here knows about resilient."""

from __future__ import annotations

import argparse

import torch
from torch import nn

VOCAB, SEQ = 32, 16


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for layer in self.layers:
            x = layer(x, src_mask=self.mask, is_causal=True)
        # a copy, not the matmul's reshaped view: FSDP2 warns on a root module returning a view
        return self.head(x).clone()


def sample(index: int, seed: int) -> torch.Tensor:
    """Sample ``index`` of the data set: a noisy arithmetic sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(SEQ + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, VOCAB, (SEQ + 1,), generator=g), seq)


class ResumableSampler:
    """Global sample indices in a seeded order, epoch by epoch; a ``Stateful`` (its position
    is the number of samples the job consumed), so a restore continues exactly."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.position = size, seed, 0

    def next_batch(self, global_batch: int) -> list[int]:
        out = []
        for _ in range(global_batch):
            epoch, offset = divmod(self.position, self.size)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
            out.append(int(order[offset]))
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def batch_for(ids: list[int], seed: int) -> torch.Tensor:
    return torch.stack([sample(i, seed) for i in ids])


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset-size", type=int, default=4096)
    ap.add_argument("--trace", default="", help="append each rank's sample ids per step here (JSON lines)")
    ap.add_argument("--pace", type=float, default=0.0, help="sleep this long in each step: time to watch the "
                    "tiers, or to kill a worker or a node mid-run")
    ap.add_argument("--dim", type=int, default=32, help="model width (a multiple of 2, the heads)")
    ap.add_argument("--layers", type=int, default=2, help="transformer layers")
    return ap.parse_args()


def init_process_group() -> None:
    """gloo over the launcher's environment (torchrun, ``resilient launch``); under plain
    ``python``, a job of one process."""
    import os

    import torch.distributed as dist

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def trace(path: str, step: int, rank: int, world: int, ids: list[int]) -> None:
    """One JSON line: the sample ids ``rank`` trained on in ``step`` (tests read it)."""
    import json
    import os

    line = json.dumps({"step": step, "rank": rank, "world": world, "ids": ids,
                       "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
    with open(path, "a") as f:
        f.write(line + "\n")


class Batches:
    """Each step's batch of this rank, drawn from the sampler once per step: a replay (the SDC
    checks recompute a suspect step) must see the same batch, not the next one."""

    def __init__(self, model: nn.Module, sampler: ResumableSampler, args: argparse.Namespace, rank: int, world: int):
        self.model, self.sampler, self.args, self.rank = model, sampler, args, rank
        self.local = args.global_batch // world
        self._ids: dict[int, list[int]] = {}

    def ids(self, step: int) -> list[int]:
        if step not in self._ids:
            self._ids = {step: self.sampler.next_batch(self.args.global_batch)[
                self.rank * self.local:(self.rank + 1) * self.local]}
        return self._ids[step]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of step ``step``."""
        data = batch_for(self.ids(step), self.args.seed)
        return data[:, :-1], data[:, 1:]

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch (what a cross-device replay recomputes, without gradients)."""
        import torch.nn.functional as F

        return F.cross_entropy(self.model(inputs).reshape(-1, VOCAB), targets.reshape(-1))

    def forward_backward(self, step: int) -> torch.Tensor:
        """The loss of step ``step`` on this rank's share of the batch, gradients accumulated."""
        if getattr(self.args, "pace", 0):
            import time

            time.sleep(self.args.pace)
        loss = self.loss(*self.batch(step))
        loss.backward()
        return loss
