"""False alarms and cost of the compute checks (checksummed Linear GEMMs, block output ranges).

One process, the monitor's own hooks (SdcMonitor.after_backward / after_optimizer_step),
no data parallelism: what the checks see is what one rank computes.

* ``--model demo``: resilient's GPT at configs/demo.toml's size (dim 128, 4 layers, 4 heads,
  byte vocabulary, 128-token sequences, 8 sequences a step: one of the demo's two ranks),
  trained with AdamW on bytes of the Python standard library (the demo's corpus);
* ``--model toy``: examples/toy.py's TinyTransformer at examples/fsdp2_train.py's defaults
  (dim 32, 2 layers, 4 sequences a step: one of two ranks).

It trains ``--steps`` clean steps with the checks on and counts suspicions (there must be
none), reports the largest |Δ|/bound any passing GEMM reached (the bound's margin), then
times ``--time-steps`` steps with the checks on and off, interleaved in blocks of 10 so a
busy neighbour on a shared machine slows both alike, and reports the median process CPU
time per step of each::

    python bench/sdc_compute.py --model demo --steps 300
    python bench/sdc_compute.py --model toy --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from resilient.sdc.api import SdcConfig  # noqa: E402
from resilient.sdc.monitor import SdcMonitor  # noqa: E402


def stdlib_bytes(limit: int = 4 << 20) -> torch.Tensor:
    out, n = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        n += len(data)
        if n >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()


def build(kind: str):
    """(model, batch(step) -> (inputs, targets), vocab)."""
    torch.manual_seed(0)
    if kind == "demo":
        from resilient.gpt.config import ModelConfig
        from resilient.gpt.model import GPT, init_parameters

        model = GPT(ModelConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=128))
        init_parameters(model, seed=0)
        corpus = stdlib_bytes()

        def batch(step: int):
            g = torch.Generator().manual_seed(step)
            starts = torch.randint(0, corpus.numel() - 129, (8,), generator=g)
            seqs = torch.stack([corpus[s:s + 129] for s in starts.tolist()])
            return seqs[:, :-1], seqs[:, 1:]
        return model, batch, 256
    from toy import VOCAB, TinyTransformer, batch_for

    model = TinyTransformer()

    def batch(step: int):
        seqs = batch_for([step * 4 + i for i in range(4)], 0)
        return seqs[:, :-1], seqs[:, 1:]
    return model, batch, VOCAB


def run(kind: str, steps: int, time_steps: int, only: str = "both") -> dict:
    model, batch, vocab = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mon = SdcMonitor(SdcConfig(abft_every=1, activation_every=1, probe_dtypes=("float32",)))
    mon.watch_compute(model)
    mon.note_restored(0, model)

    def step_once(step: int, checks: bool) -> tuple[list, float]:
        for name, chk in (("gemms", mon.gemms), ("activations", mon.activations)):
            chk.arm(checks and only in (name, "both"))
        t0 = time.process_time()
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        sus = mon._compute_checks(step, judge=True) if checks else []
        dt = time.process_time() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sus, dt, loss.item()

    suspicions, losses = [], []
    for step in range(1, steps + 1):
        sus, _, loss = step_once(step, True)
        suspicions += sus
        losses.append(loss)
    on, off = [], []
    for block in range(time_steps // 10):
        for checks, times in ((True, on), (False, off)) if block % 2 == 0 else ((False, off), (True, on)):
            for i in range(10):
                times.append(step_once(steps + 1 + block * 20 + len(times), checks)[1])
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {"model": kind, "clean_steps": steps, "suspicions": [s.as_event() for s in suspicions],
            "gemms_covered": len(mon.gemms.covered), "activations_watched": len(mon.activations.names),
            "max_clean_ratio": mon.gemms.max_clean_ratio, "loss_first_last": [losses[0], losses[-1]],
            "step_cpu_s_off": round(med_off, 5), "step_cpu_s_on": round(med_on, 5),
            "checks": only, "overhead_pct": round(100 * (med_on - med_off) / med_off, 1), "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("demo", "toy"), default="demo")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--time-steps", type=int, default=60)
    ap.add_argument("--only", choices=("both", "gemms", "activations"), default="both",
                    help="which compute checks run (their costs apart)")
    args = ap.parse_args()
    print(json.dumps(run(args.model, args.steps, args.time_steps, args.only)))


if __name__ == "__main__":
    main()
