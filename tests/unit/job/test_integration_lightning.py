"""The Lightning adapter (resilient.integrations.lightning) in one process, on the durable
tier: a fit killed by an exception in ``training_step`` resumes bitwise, SIGTERM ends a fit
with its step durable, and the SDC checks replay a flipped gradient through Lightning's
strategy and roll a flipped parameter back. The LightningModule and data are
examples/lightning_train.py's, with dropout added so the RNGs must come back too."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import warnings

import pytest
import torch
from launchutil import REPO

from resilient.events import read_events
from resilient.job import NotUnderAgent
from resilient.runconfig import load_runtime_config

if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("PyTorch Lightning is not installed: pip install 'resilient[lightning]' (CI installs it with the "
                "test extra)", allow_module_level=True)

sys.path.insert(0, str(REPO / "examples"))
from lightning_train import SampleBatches, TinyLM, trainer_for  # noqa: E402
from toy import ResumableSampler  # noqa: E402

from resilient.integrations.lightning import ResilientCallback, SdcRollback  # noqa: E402

STEPS = 14          # epochs of 6 batches: the run crosses two epoch boundaries


class Crash(Exception):
    pass


class Module(TinyLM):
    """The example's module with dropout on the logits (the RNG matters) and a fault at a step."""

    def __init__(self, crash_at: int | None = None, sigterm_at: int | None = None):
        super().__init__(lr=1e-2, warmup=4)
        self.drop = torch.nn.Dropout(0.1)
        self.crash_at, self.sigterm_at = crash_at, sigterm_at

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        if step == self.crash_at:
            raise Crash(step)
        if step == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        logits = self.drop(self.model(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def fit(run_dir, *sets: str, steps: int = STEPS, **faults):
    """One ``trainer.fit`` of the module with the callback; returns (trainer, module, callback)."""
    torch.manual_seed(0)
    module = Module(**faults)
    data = SampleBatches(ResumableSampler(64, 0), 4, 0, batches_per_epoch=6)
    callback = ResilientCallback(run_dir=run_dir, progress=False,
                                 config=load_runtime_config(None, ["snapshot.durable_every=1", *sets]))
    trainer = trainer_for(steps, [callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotUnderAgent)
        trainer.fit(module, train_dataloaders=data)
    return trainer, module, callback


def events(run_dir, kind):
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == kind]


def params(module) -> list:
    return [p.detach().clone() for p in module.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted fit every faulty one must equal."""
    trainer, module, _ = fit(tmp_path_factory.mktemp("ref"))
    return (params(module), trainer.optimizers[0].state_dict(), trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            trainer.current_epoch)


def test_a_killed_fit_resumes_from_durable_bitwise(tmp_path, reference):
    ref_params, ref_optim, ref_sched, ref_epoch = reference
    with pytest.raises(Crash):
        fit(tmp_path, crash_at=9)
    trainer, module, callback = fit(tmp_path)
    (restored,) = events(tmp_path, "restore")
    assert 1 <= restored["step"] <= 9 and callback.job.restored.step == restored["step"], restored
    assert events(tmp_path, "run_start")[-1]["start_step"] == restored["step"]
    assert trainer.global_step == STEPS and trainer.current_epoch == ref_epoch
    assert same(params(module), ref_params), "parameters differ from the uninterrupted fit"
    optim = trainer.optimizers[0].state_dict()
    assert all(same(list(optim["state"][i].values()), list(ref_optim["state"][i].values())) for i in ref_optim["state"])
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == ref_sched
    steps = [e["step"] for e in events(tmp_path, "step")]
    assert steps[-1] == STEPS and set(steps) == set(range(1, STEPS + 1)), steps
    assert events(tmp_path, "run_end")[-1]["step"] == STEPS


def test_sigterm_ends_the_fit_with_its_step_durable_and_the_next_fit_resumes(tmp_path, reference):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:   # Lightning's SIGTERMException, after the callback saved
        fit(tmp_path, sigterm_at=4)
    assert ended.value.code in (0, None)
    (end,) = events(tmp_path, "run_end")
    assert end["step"] == 5 and end["preempted"], end
    assert 5 in [e["step"] for e in events(tmp_path, "commit")], "the preempted step is not durable"
    assert signal.getsignal(signal.SIGTERM) == before, "a handler outlived the fit"
    trainer, module, callback = fit(tmp_path)
    assert callback.job.restored.step == 5 and trainer.global_step == STEPS
    assert same(params(module), reference[0])


def test_a_flipped_gradient_is_replayed_through_lightning_bitwise(tmp_path, reference):
    flip = 'sdc.inject=[{target="grad", tensor="model.head.weight", bit=30, element=3, rank=0, step=13}]'
    _, module, _ = fit(tmp_path, flip)
    assert events(tmp_path, "sdc_suspect"), "the flip went unseen"
    assert [v["verdict"] for v in events(tmp_path, "sdc_verdict")] == ["transient"]
    assert same(params(module), reference[0]), "the replayed step (dropout and all) differs from the clean fit"


def test_a_flipped_parameter_rolls_back_and_the_next_fit_resumes_bitwise(tmp_path, reference):
    flip = 'sdc.inject=[{target="param", tensor="model.head.weight", bit=31, element=0, rank=0, step=6}]'
    with pytest.raises(SdcRollback, match="run the fit again"):
        fit(tmp_path, flip)
    (rollback,) = [e for e in events(tmp_path, "rollback") if "step" not in e]
    _, module, callback = fit(tmp_path)
    assert callback.job.restored.step == rollback["to_step"]
    assert same(params(module), reference[0])
