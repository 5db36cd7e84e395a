"""The library API in a plain torch training loop: kill-and-resume is bitwise equal to not stopping."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resilient.snapshot import Snapshotter, rng_state, set_rng_state


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, data_gen: torch.Generator) -> float:
    x = torch.randn(8, 16, generator=data_gen)
    y = torch.randn(8, 4, generator=data_gen)
    loss = nn.functional.mse_loss(model(torch.nn.functional.dropout(x, 0.1)), y)  # dropout: global RNG matters
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    url = f"file://{tmp_path}/ck"
    # Reference: 6 steps without stopping.
    model, opt = make()
    data = torch.Generator().manual_seed(1)
    ref_losses = [train_step(model, opt, data) for _ in range(6)]
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    # Run 1: 4 steps, snapshot every 2, then "killed".
    model, opt = make()
    data = torch.Generator().manual_seed(1)
    snap = Snapshotter(url, every=2, config_digest="mlp-16-32-4")
    for step in range(1, 5):
        train_step(model, opt, data)
        msd, osd = get_state_dict(model, opt)
        snap.save(step, {"model": msd, "optim": osd}, extra={"rng": rng_state({"data": data})},
                  global_extra={"sample": step * 8})
    snap.wait(timedelta(seconds=30))
    snap.close()

    # Run 2: fresh process state, restore, train the remaining steps.
    model, opt = make(seed=123)
    data = torch.Generator().manual_seed(999)
    snap = Snapshotter(url, every=2, config_digest="mlp-16-32-4")
    msd, osd = get_state_dict(model, opt)  # initialises optimizer state so it has tensors to fill
    got = snap.restore({"model": msd, "optim": osd})
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    set_rng_state(got.extra["rng"], {"data": data})
    assert got.step == 4 and got.global_extra == {"sample": 32}
    losses = [train_step(model, opt, data) for _ in range(got.step, 6)]
    snap.close()
    assert losses == ref_losses[4:]
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_a_failing_rank_does_not_wait_for_commits_that_need_its_dead_peers(tmp_path):
    """close(commit=False): the writes finish, the commit that needs a rank manifest that
    will never come is not waited for (a failed worker used to hang until killed)."""
    import threading

    model, opt = make()
    snap = Snapshotter((tmp_path / "ckpt").as_uri(), every=1)
    snap._committer.world = 2  # as if rank 1 of a 2-rank job: its manifest never lands
    model_sd, optim_sd = get_state_dict(model, opt)
    snap.save(0, {"model": model_sd, "optim": optim_sd})
    closing = threading.Thread(target=snap.close, kwargs={"timeout": timedelta(minutes=10), "commit": False})
    closing.start()
    closing.join(60)
    assert not closing.is_alive(), "close(commit=False) waited for a commit that needs a dead rank"
    assert any((tmp_path / "ckpt").rglob("r00000.json")), "this rank's writes must still finish"
    assert not any((tmp_path / "ckpt").rglob("manifest.json")), "nothing may be committed without rank 1"
