"""A transient injected flip strikes once per run: the strike is noted in the run dir
(0600 in a 0700 directory) before the bit flips, so a worker killed after it and
restarted, which meets the flip's step again, does not strike a second time."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
import textwrap

import torch
from torch import nn

from resilient.sdc.inject import BitFlipInjector, FlipSpec, StrikeRecord

SPEC = {"target": "grad", "tensor": "weight", "bit": 30, "rank": 0, "step": 3}


def _grad_step(inj: BitFlipInjector, step: int) -> dict | None:
    torch.manual_seed(0)
    m = nn.Linear(4, 2, bias=False)
    m(torch.ones(1, 4)).sum().backward()
    return inj.maybe_inject(step, m)


def test_a_transient_flip_strikes_once_across_a_killed_worker(tmp_path):
    strikes = tmp_path / "run" / "sdc-strikes"
    child = textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from resilient.sdc.inject import BitFlipInjector, FlipSpec, StrikeRecord
        spec = FlipSpec.from_dict({SPEC!r})
        inj = BitFlipInjector(spec, 0, record=StrikeRecord({str(strikes)!r}, 0, spec))
        m = nn.Linear(4, 2, bias=False)
        m(torch.ones(1, 4)).sum().backward()
        assert inj.maybe_inject(3, m) is not None
        print("struck", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)   # the worker dies right after the flip
        """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL and "struck" in proc.stdout, proc.stderr[-2000:]
    (note,) = strikes.iterdir()
    assert stat.S_IMODE(note.stat().st_mode) == 0o600 and stat.S_IMODE(strikes.stat().st_mode) == 0o700

    spec = FlipSpec.from_dict(SPEC)
    restarted = BitFlipInjector(spec, 0, record=StrikeRecord(strikes, 0, spec))
    assert _grad_step(restarted, 3) is None and restarted.fired == 0   # the restarted worker: no second strike
    # another flip of the run (another index or other fields) has its own record
    other = FlipSpec.from_dict({**SPEC, "bit": 29})
    assert _grad_step(BitFlipInjector(other, 0, record=StrikeRecord(strikes, 1, other)), 3) is not None
    # a persistent fault is a bad device: it strikes on every call, restarts or not
    bad = FlipSpec.from_dict({**SPEC, "persistent": True})
    rec = StrikeRecord(strikes, 2, bad)
    assert all(_grad_step(BitFlipInjector(bad, 0, record=rec), s) is not None for s in (3, 4))
    assert not rec.struck()
