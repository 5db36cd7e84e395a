"""The GPU checks, one prepared script for a lent GPU machine: ``python bench/gpu_check.py --out DIR``.

Why one script: a lent GPU is counted by the minute, so everything that needs
CUDA runs in one call that cannot stop half-way (each check has its own
timeout, records its result, and the next one runs). What only a GPU shows:

1. ``trainer``: ``resilient launch`` of the demo model on ``cuda`` with nccl
   (one GPU: one worker), bf16 autocast, SDPA, snapshots every step into the
   node store (device-to-host copies into pinned memory), SDC checks on; run
   twice fault-free, to see whether a GPU run is bitwise repeatable.
2. ``kill``: the same run with its worker killed (SIGKILL) mid-run: the
   replacement restores from the node's RAM onto the GPU; its final
   parameters are compared with the fault-free run's.
3. ``flip``: a bit flipped in a parameter on the GPU at a step: the SDC
   checks see it, the run rolls back and finishes.
4. ``probes``: the arithmetic-probe tests with their CUDA cases.
5. ``pinned``: the cost of pinned host buffers (the capture ring's), torch's
   default allocator against malloc + cudaHostRegister on 8 threads.
6. ``profile``: bench/gpu_profile.py (MFU of the ~1B model, snapshot stall
   blocking and on a side stream, restore from host RAM).
7. ``recovery_big``: issue 5's recovery on ~1 GB of state (the model of
   ``bench_recovery_big``) where a step takes milliseconds, not the seconds it
   takes on 2 CPU cores: kill -9 of the one worker → first completed step,
   resilient restoring from the node's RAM against torchrun + durable, 2 kills each.

Writes ``DIR/gpu_check.json`` (one summary) and per-check logs; prints the summary.
``--cpu`` runs checks 1-3 on the CPU to test this script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from launchutil import Agent, digests, events, run_launch, steps_done, tiny_overrides, wait_for, worker_pids  # noqa: E402

STEPS = 30


def overrides(corpus: Path, device: str, **extra) -> list[str]:
    return tiny_overrides(corpus, STEPS, **{"train.device": device, "snapshot.every": 1,
                                           "snapshot.durable_every": 0, "launch.heartbeat_timeout": 60.0,
                                           "train.log_every": 5, **extra})


def summary_of(run: Path) -> dict:
    steps = [e for e in events(run, "step") if e["rank"] == 0]
    restores = [e for e in events(run, "restore") if e.get("step", 0) > 0]
    sdc = [e["event"] for e in events(run) if e["event"].startswith("sdc") or e["event"] in ("rollback", "fault_injected")]
    return {"steps": len(steps), "first_loss": steps[0]["loss"] if steps else None,
            "last_loss": steps[-1]["loss"] if steps else None,
            "tokens_per_s": steps[-1].get("tokens_per_s") if steps else None,
            "digests": digests(run),
            "restores": [{k: e.get(k) for k in ("rank", "step", "tier", "seconds", "stage_s", "copy_s")} for e in restores],
            "sdc_events": sorted(set(sdc))}


class Checks:
    def __init__(self, out: Path, device: str):
        self.out, self.device = out, device
        self.work = Path(tempfile.mkdtemp(prefix="resilient-gpu-check-"))
        self.res: dict = {"device": device, "checks": {}}
        from resilient.gpt.data import prepare

        self.corpus = prepare("python-stdlib", self.work / "corpus", max_bytes=400_000)

    def launch(self, name: str, raw: tuple[str, ...] = ()) -> dict:
        run = self.work / name
        t0 = time.perf_counter()
        proc = run_launch(REPO / "configs" / "demo.toml", run, overrides(self.corpus, self.device) + list(raw),
                          nproc=1, timeout=240, check=False)
        (self.out / f"{name}.log").write_text(proc.stdout[-20000:] + "\n--- stderr\n" + proc.stderr[-20000:])
        res = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), **summary_of(run)}
        return res

    def trainer(self) -> dict:
        a = self.launch("ref")
        b = self.launch("ref2")
        self.ref = a
        return {"ref": a, "ref2": b, "bitwise_repeatable": bool(a["digests"]) and a["digests"] == b["digests"]}

    def kill(self) -> dict:
        from resilient_chaos.etcd_testing import embedded_etcd

        run = self.work / "kill"
        run.mkdir()
        t0 = time.perf_counter()
        with embedded_etcd() as etcd:
            agent = Agent(REPO / "configs" / "demo.toml", run, overrides(self.corpus, self.device), "n0",
                          endpoint=etcd.endpoint, nproc=1)
            try:
                wait_for(lambda: steps_done(run) >= 10, 180, "the first steps")
                os.kill(worker_pids(run)[0], signal.SIGKILL)
                rc = agent.wait(240)
            finally:
                (self.out / "kill.log").write_text(agent.output()[-20000:])
                agent.close()
        res = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), **summary_of(run)}
        res["equal_to_ref"] = res["digests"] == getattr(self, "ref", {}).get("digests")
        return res

    def flip(self) -> dict:
        spec = 'sdc.inject=[{target = "param", tensor = "layers.0.attention.wq.weight", bit = 30, rank = 0, step = 12}]'
        res = self.launch("flip", (spec,))
        res["equal_to_ref"] = res["digests"] == getattr(self, "ref", {}).get("digests")
        return res

    def pinned(self) -> dict:
        """Pinned host memory: allocating it (3 slots of 4 GiB, as a ring of 2 writers + 1 holds)
        with torch's default (cudaHostAlloc) against malloc + cudaHostRegister on 8 threads,
        each in a fresh process (the allocator reads its settings once), and D2H GB/s into it."""
        code = (
            "import json,time,torch\n"
            "n=4<<30; torch.cuda.init(); src=torch.empty(n,dtype=torch.uint8,device='cuda'); torch.cuda.synchronize()\n"
            "t=time.perf_counter(); bufs=[torch.empty(n,dtype=torch.uint8,pin_memory=True) for _ in range(3)]\n"
            "alloc=time.perf_counter()-t\n"
            "bufs[0].copy_(src,non_blocking=True); torch.cuda.synchronize()\n"
            "t=time.perf_counter(); bufs[1].copy_(src,non_blocking=True); torch.cuda.synchronize(); d2h=time.perf_counter()-t\n"
            "page=torch.empty(n,dtype=torch.uint8); page.copy_(src); t=time.perf_counter(); page.copy_(src); pg=time.perf_counter()-t\n"
            "print(json.dumps({'alloc_3x4GiB_s':round(alloc,2),'d2h_pinned_GBps':round(n/d2h/1e9,1),"
            "'d2h_pageable_GBps':round(n/pg/1e9,1),'pinned':bufs[0].is_pinned()}))\n")
        out = {}
        for name, conf in (("default", ""), ("host_register_8",
                           "pinned_use_cuda_host_register:True,pinned_num_register_threads:8")):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
            try:
                out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                out[name] = {"rc": proc.returncode, "stderr": proc.stderr[-1500:]}
        return out

    def recovery_big(self) -> dict:
        sys.path.insert(0, str(REPO / "bench"))
        from bench_recovery import measure, summarize
        from bench_recovery_big import BIG, VARIANTS

        # --cpu tests this plumbing on the tiny model: the 1 GB one steps in ~10 s on a CPU core
        sets = {**(BIG if self.device == "cuda" else {}), "train.device": self.device}
        names = {k: VARIANTS[k] for k in ("resilient_ram", "torchrun")}
        got, _ = measure(names, 1, 2, "resilient-gpu-recovery-big-", sets, nproc=1)
        figures, ratios = summarize(got, ", 1 GiB of state")
        keep = ("recovery_s", "run_start_s", "detected_s", "restore_s", "tier", "lost_steps")
        return {"kills": {n: [{k: r.get(k) for k in keep} for r in rs] for n, rs in got.items()},
                "median_s": {n: f["median"] for n, f in figures.items() if f.get("unit") == "s"},
                "torchrun_over_resilient": ratios["torchrun_over_resilient_ram"]["value"]}

    def probes(self) -> dict:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "tests/unit/sdc/test_sdc_probes.py"], cwd=REPO, capture_output=True, text=True, timeout=180)
        (self.out / "probes.log").write_text(proc.stdout[-20000:] + proc.stderr[-5000:])
        return {"rc": proc.returncode, "tail": proc.stdout.strip().splitlines()[-1:]}

    def profile(self, budget: float) -> dict:
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_profile.py"), "--budget", str(budget),
                               "--steps", "8"], cwd=REPO, capture_output=True, text=True, timeout=budget + 200)
        (self.out / "profile.log").write_text(proc.stderr[-20000:])
        try:
            return json.loads(proc.stdout[proc.stdout.index("{"):])
        except ValueError:
            return {"rc": proc.returncode, "stdout": proc.stdout[-2000:]}

    def run(self, names: list[str], profile_budget: float) -> dict:
        for name in names:
            t0 = time.perf_counter()
            try:
                got = self.profile(profile_budget) if name == "profile" else getattr(self, name)()
            except Exception as e:  # record and go on: one summary whatever happens
                got = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
                traceback.print_exc()
            got["check_s"] = round(time.perf_counter() - t0, 1)
            self.res["checks"][name] = got
            (self.out / "gpu_check.json").write_text(json.dumps(self.res, indent=1))
            print(f"[gpu_check] {name} done in {got['check_s']} s", flush=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return self.res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu-check"))
    ap.add_argument("--cpu", action="store_true", help="run the trainer checks on the CPU (tests this script)")
    ap.add_argument("--only", default="trainer,kill,flip,probes,pinned,recovery_big,profile")
    ap.add_argument("--profile-budget", type=float, default=150.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "reason": "no CUDA device"}))
        return 0
    checks = Checks(args.out, "cpu" if args.cpu else "cuda")
    checks.res["torch"] = torch.__version__
    if not args.cpu:
        checks.res["gpu"] = torch.cuda.get_device_name()
    res = checks.run(args.only.split(","), args.profile_budget)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
