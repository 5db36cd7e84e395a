"""GPU profile for a lent H100/H200, about 5 minutes: ``python bench/gpu_profile.py``.

Why: the CPU rows cannot show what matters on a GPU fleet: how much of the
peak the real model code reaches, how much a per-step snapshot (device-to-host
copy into pinned memory on a side stream) costs as a share of the step, and
how fast state comes back from host RAM. Three phases, each guarded (a failure
is recorded in the summary and the next phase runs), one JSON summary on
stdout at the end:

1. MFU: the ~1B GPT of configs/gpu-1b-8gpu.toml (resilient.gpt.model.GPT) on one
   GPU, fp32 master weights, bf16 autocast (what the trainer does at dp=1),
   SDPA forced to the flash kernel (falls back to SDPA's own choice, and says
   so, if flash refuses), fused AdamW, random tokens. MFU = achieved model
   FLOP/s (resilient.gpt.model.flops_per_token) / the device's dense bf16 peak.
2. Snapshot stall: the same loop with ``Snapshotter.save`` of parameters +
   Adam state (~13 GB) every step, blocking (``overlap=False``) and with the
   side-stream copy (``overlap=True`` + ``fence()`` before ``optimizer.step``);
   step time vs the plain loop. The background upload goes to a tmpfs/disk
   scratch dir with keep_last=1 (captures coalesce while it runs).
3. Recovery from host RAM: ``Snapshotter.restore`` of the newest version (its
   files are in the page cache / tmpfs) into the live model and optimizer.

Step times: the host waits for the training stream at the end of each step
(not the whole device), so the side-stream capture can overlap the next step;
``fence`` makes the next optimizer step wait for it, so what does not overlap
is still counted.

On a machine without a GPU it prints ``{"gpu": false, ...}`` and exits 0. A
failed phase is recorded under ``errors`` (exit 0); if nothing could run, the
summary has ``fatal`` and the exit code is 1.
Options: ``--steps N`` (timed steps per phase), ``--batch B`` (micro-batch;
halved on OOM), ``--budget S`` (skip remaining phases after S seconds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def peak_tflops(known) -> float:
    """Dense bf16 peak of this GPU: resilient's table (H100/H200 SXM: 989), except the H100
    PCIe (756), which that table's substring match would rate as an SXM part."""
    import torch

    name = torch.cuda.get_device_name()
    if "H100" in name and "PCIe" in name:
        return 756.0
    return known("cuda") or 989.0


def scratch_dir(need_bytes: int) -> str:
    """tmpfs when it has room for ~3 versions (it is host RAM, like the node store), else the temp dir."""
    for d in ("/dev/shm", tempfile.gettempdir()):
        try:
            if shutil.disk_usage(d).free > 3 * need_bytes:
                return tempfile.mkdtemp(prefix="resilient-gpu-profile-", dir=d)
        except OSError:
            continue
    return tempfile.mkdtemp(prefix="resilient-gpu-profile-")


class Seen:
    """An event sink that keeps what it is given (the restore's own timing breakdown)."""

    def __init__(self):
        self.seen: list[dict] = []

    def emit(self, kind: str, **fields) -> None:
        self.seen.append({"kind": kind, **fields})


class Profile:
    def __init__(self, args: argparse.Namespace):
        import torch

        from resilient.gpt.config import load_config
        from resilient.gpt.model import GPT, cross_entropy, flops_per_token
        from resilient.progress import device_peak_tflops

        self.torch, self.args, self.t_start = torch, args, time.time()
        smoke = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=256",
                 "model.max_seq_len=64", "train.seq_len=64"]
        self.cfg = load_config(REPO / "configs" / "gpu-1b-8gpu.toml", smoke if args.smoke else None)
        self.seq = min(self.cfg.train.seq_len, self.cfg.model.max_seq_len)
        self.cuda = not args.smoke
        self.dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.dev)
        with torch.device(self.dev):
            self.model = GPT(self.cfg.model)  # default init on the GPU: fast; values do not matter here
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                     fused=self.cuda)
        self.loss_fn = cross_entropy
        self.fpt = flops_per_token(self.cfg.model, self.seq)
        self.peak = (peak_tflops(device_peak_tflops) if self.cuda else 1.0) * 1e12
        self.batch = args.batch
        self.events = Seen()
        self.sdpa = "flash"
        self.out: dict = {"gpu": self.cuda, "device": torch.cuda.get_device_name() if self.cuda else "cpu (--smoke)",
                          "torch": torch.__version__,
                          "params": sum(p.numel() for p in self.model.parameters()), "seq_len": self.seq,
                          "peak_tflops_assumed": self.peak / 1e12, "errors": {}}

    # ------------------------------------------------------------ the loop
    def _ctx(self):
        import contextlib

        torch = self.torch
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.dev.type, dtype=torch.bfloat16))
        if self.sdpa == "flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
        return stack

    def step(self, before_opt=None) -> None:
        torch = self.torch
        x = torch.randint(0, self.cfg.model.vocab_size, (self.batch, self.seq + 1), device=self.dev)
        with self._ctx():
            loss = self.loss_fn(self.model(x[:, :-1]), x[:, 1:])
        loss.backward()
        if before_opt is not None:
            before_opt()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def sync_compute(self) -> None:
        """Wait for the training (current) stream only. A device-wide synchronize would also
        wait for the snapshot's side-stream copy at the end of every step and so hide the
        overlap being measured; the capture is still paid for where it must be: ``fence``
        makes the next optimizer step (on this stream) wait for it."""
        if self.cuda:
            self.torch.cuda.current_stream().synchronize()

    def timed(self, n: int, after_step=None, before_opt=None) -> list[float]:
        out = []
        self.sync()
        for i in range(n):
            t0 = time.perf_counter()
            self.step(before_opt)
            if after_step is not None:
                after_step(i)
            self.sync_compute()
            out.append(time.perf_counter() - t0)
        self.sync()
        return out

    def warm_up(self) -> None:
        """Two steps; flash refused → SDPA's own choice; OOM → halve the batch."""
        torch = self.torch
        while True:
            try:
                self.timed(2)
                return
            except torch.cuda.OutOfMemoryError:
                self.opt.zero_grad(set_to_none=True)
                self.empty_cache()
                if self.batch == 1:
                    raise
                self.batch //= 2
            except RuntimeError as e:
                if self.sdpa != "flash":
                    raise
                self.out["errors"]["flash"] = f"{type(e).__name__}: {str(e)[:300]}"
                self.sdpa = "default"
                self.opt.zero_grad(set_to_none=True)

    # ------------------------------------------------------------- phases
    def mfu(self) -> None:
        import statistics

        self.warm_up()
        ts = self.timed(self.args.steps)
        med = statistics.median(ts)
        tok_s = self.batch * self.seq / med
        self.base_step = med
        self.out.update(batch=self.batch, sdpa=self.sdpa, step_s=round(med, 4),
                        step_s_min_max=[round(min(ts), 4), round(max(ts), 4)], tokens_per_s=round(tok_s),
                        mfu=round(tok_s * self.fpt / self.peak, 4),
                        max_memory_gb=round(self.torch.cuda.max_memory_allocated() / 2**30, 1) if self.cuda else None)

    def state(self) -> dict:
        """Parameters + Adam moments as one flat dict of GPU tensors (global names)."""
        st = {f"model.{n}": p for n, p in self.model.named_parameters()}
        for n, p in self.model.named_parameters():
            for k, v in self.opt.state.get(p, {}).items():
                if self.torch.is_tensor(v) and v.dim() > 0:
                    st[f"optim.{n}.{k}"] = v
        return st

    def stall(self) -> None:
        import statistics

        from resilient.snapshot import Snapshotter

        state = self.state()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self.scratch = scratch_dir(nbytes)
        self.out["snapshot_bytes_gb"] = round(nbytes / 2**30, 2)
        self.out["snapshot_scratch"] = self.scratch
        base = statistics.median(self.timed(self.args.steps))
        res = {"plain_step_s": round(base, 4)}
        for mode, overlap in (("blocking", False), ("side_stream", True)):
            snap = Snapshotter(f"file://{self.scratch}/{mode}", every=1, keep_last=1, overlap=overlap,
                               events=self.events)
            t0 = time.perf_counter()
            snap.prepare(state)  # pinned host buffers, allocated once
            res[f"{mode}_prepare_s"] = round(time.perf_counter() - t0, 2)
            blocked: list[float] = []
            step_no = [0]

            def save(_i: int, snap=snap, blocked=blocked, step_no=step_no) -> None:
                step_no[0] += 1
                t = time.perf_counter()
                snap.save(step_no[0], state)
                blocked.append(time.perf_counter() - t)

            fence = snap.fence if overlap else None
            self.timed(1, save, fence)  # first capture: plan and buffers in use
            blocked.clear()
            ts = self.timed(self.args.steps, save, fence)
            med = statistics.median(ts)
            res[f"{mode}_step_s"] = round(med, 4)
            res[f"{mode}_save_call_s"] = round(statistics.median(blocked), 4)
            res[f"{mode}_stall_share"] = round((med - base) / base, 4)
            if mode == "side_stream":
                self.snap = snap  # kept for the restore phase
            else:
                snap.close()
                shutil.rmtree(f"{self.scratch}/{mode}", ignore_errors=True)  # ~13 GB of tmpfs/disk back
                # drop every reference to its pinned buffers before the next one allocates
                snap = save = fence = None  # noqa: F841
                gc.collect()
        self.out["stall"] = res

    def restore(self) -> None:
        torch = self.torch
        snap = self.snap
        t0 = time.perf_counter()
        ok = snap.wait(timedelta(seconds=max(30.0, self.args.budget + 60 - (time.time() - self.t_start))))
        self.out["restore_wait_upload_s"] = round(time.perf_counter() - t0, 2)
        if not ok:
            raise RuntimeError("the upload did not finish in time")
        state = self.state()
        with torch.no_grad():
            for t in state.values():
                t.zero_()  # prove the values come back
        self.sync()
        t0 = time.perf_counter()
        got = snap.restore(state)
        self.sync()
        dt = time.perf_counter() - t0
        ev = next((e for e in reversed(self.events.seen) if e["kind"] == "restore"), {})
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self.out["restore"] = {"seconds": round(dt, 3), "step": getattr(got, "step", None),
                               "gb_s": round(nbytes / 2**30 / dt, 2),
                               "nonzero": bool(any(t.abs().sum().item() > 0 for t in list(state.values())[:4])),
                               **{k: ev.get(k) for k in ("stage_s", "agree_s", "copy_s")}}
        snap.close()

    def empty_cache(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def run(self) -> dict:
        for name in ("mfu", "stall", "restore"):
            if time.time() - self.t_start > self.args.budget:
                self.out["errors"][name] = "skipped: over the time budget"
                continue
            if name == "restore" and not hasattr(self, "snap"):
                self.out["errors"][name] = "skipped: no snapshot from the stall phase"
                continue
            try:
                getattr(self, name)()
            except Exception as e:  # record and go on: one summary whatever happens
                self.out["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
                traceback.print_exc(file=sys.stderr)
                self.empty_cache()
        if getattr(self, "scratch", None):
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.out["wall_s"] = round(time.time() - self.t_start, 1)
        return self.out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (halved on OOM)")
    ap.add_argument("--budget", type=float, default=240.0, help="skip phases that would start after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks this script's logic, measures nothing")
    args = ap.parse_args(argv)
    # Read when the CUDA caching allocator starts: set it before torch can touch the GPU.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"gpu": False, "reason": f"torch not importable: {e}"}))
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print(json.dumps({"gpu": False, "reason": "no CUDA device: nothing to profile on this machine"}))
        return 0
    try:
        out = Profile(args).run()
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        out = {"gpu": not args.smoke, "fatal": f"{type(e).__name__}: {str(e)[:500]}"}
    print(json.dumps(out, indent=1), flush=True)
    sys.stderr.flush()
    # Background upload threads of a failed phase must not keep the process alive past the budget.
    # A phase that failed is in out["errors"] (exit 0: the other phases' numbers stand); nothing ran: 1.
    os._exit(1 if "fatal" in out else 0)


if __name__ == "__main__":
    sys.exit(main())
