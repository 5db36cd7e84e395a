"""Arithmetic probes: known-answer tests of the operations training relies on.

A device that corrupts silently still passes every health check that asks it
whether it is healthy; it fails only when asked to compute something whose
answer is known. A probe computes, in the dtypes training uses, something
whose correct value we know, and compares with a tolerance *derived* from the
arithmetic, never tuned:

* ``matmul`` on seeded normal matrices ``A (n×k) · B (k×n)``: the reference
  is computed in float64 on the CPU from the *same* (already rounded) inputs,
  so the only error allowed is the kernel's: per element
  ``|C - C_ref| ≤ γ_k(u_acc)·(|A|·|B|) + u_out·|C_ref|`` (Higham, any
  summation order or blocking), plus ``2·u_tf32·(|A|·|B|)`` when CUDA may use
  TF32 for fp32. ``u_acc`` is fp32's: cuBLAS, oneDNN and torch's CPU kernels
  accumulate bf16 products in fp32 (a platform that accumulated in bf16 would
  fail this probe on a healthy device; it would be a false alarm to report).
* ``sum`` of small integers (|x| ≤ 8) in the dtype, accumulated in fp32
  (``sum(dtype=float32)``, as careful training code reduces bf16): every
  partial sum is an integer below 2**24, exact in fp32 whatever the order, so
  the answer is exact and the tolerance is zero. Any flip in the datapath that
  changes the sum is caught, down to the lowest bit. (A bf16-*output* sum is
  not probed: torch's CPU kernel rounds partial sums to bf16, measured -48 for
  an exact -45, so its error has no order-free bound worth testing.)

Inputs are seeded (``probe_seed``) and references cached, so a probe is a
repeatable experiment; the ``matmul``/``reduce`` callables are parameters so
tests and the chaos harness can run a probe through a corrupted kernel.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable

import torch

from resilient.sdc.checksums import gamma, unit_roundoff

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ProbeResult:
    """One probe's outcome (the fields of an ``sdc_probe`` event)."""

    probe: str
    dtype: str
    device: str
    ok: bool
    max_excess: float    # max over elements of |err| / tol (≤ 1 passes)
    max_err: float
    worst_index: int
    seconds: float
    error: str = ""      # a probe that raised (a failing kernel) is a failed probe


def _tf32_possible(device: torch.device) -> bool:
    return device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest")


_REF_CACHE: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _matmul_inputs(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    key = ("mm", n, dtype, seed)
    if key not in _REF_CACHE:
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        ref = a.double() @ b.double()
        absprod = a.double().abs() @ b.double().abs()
        _REF_CACHE[key] = (a, b, ref, absprod)
    return _REF_CACHE[key]


def matmul_probe(dtype: torch.dtype, device: torch.device | str = "cpu", n: int = 256, seed: int = 1234,
                 matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul) -> ProbeResult:
    """Check ``matmul`` on ``device`` against a float64 reference (see module doc)."""
    device = torch.device(device)
    a, b, ref, absprod = _matmul_inputs(n, dtype, seed)
    t0 = time.perf_counter()
    c = matmul(a.to(device), b.to(device))
    c = c.double().cpu()
    dt = time.perf_counter() - t0
    u_acc = unit_roundoff(torch.float32)
    tol = gamma(n, u_acc) * absprod + unit_roundoff(dtype) * ref.abs()
    if _tf32_possible(device) and dtype == torch.float32:
        tol += 2 * 2.0 ** -11 * absprod
    tol = tol + torch.finfo(dtype).tiny  # no zero tolerance where the reference is exactly 0
    return _verdict("matmul", dtype, device, c, ref, tol, dt)


def fp32_sum(x: torch.Tensor) -> torch.Tensor:
    """The reduction the probe tests: a sum accumulated (and returned) in fp32."""
    return torch.sum(x, dtype=torch.float32)


def reduction_probe(dtype: torch.dtype, device: torch.device | str = "cpu", n: int = 1 << 20, seed: int = 1234,
                    reduce: Callable[[torch.Tensor], torch.Tensor] = fp32_sum) -> ProbeResult:
    """Check ``reduce`` (a sum) of small integers on ``device``: the answer is exact (module doc)."""
    device = torch.device(device)
    key = ("sum", n, dtype, seed)
    if key not in _REF_CACHE:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(-8, 9, (n,), generator=g).to(dtype)
        # keep every partial sum < 2**24 by construction (n·8 < 2**24 for n ≤ 2**21)
        _REF_CACHE[key] = (x, x.double().sum().reshape(1))
    x, ref = _REF_CACHE[key]
    if n * 8 >= 2 ** 24:
        raise ValueError(f"reduction probe n={n} too large for an exact fp32 answer; use n < 2**21")
    t0 = time.perf_counter()
    s = reduce(x.to(device)).double().cpu().reshape(1)
    dt = time.perf_counter() - t0
    tol = torch.zeros(1, dtype=torch.float64)   # exact: see the module docstring
    return _verdict("sum", dtype, device, s, ref, tol, dt)


def _verdict(name: str, dtype, device, got, ref, tol, dt) -> ProbeResult:
    err = (got - ref).abs()
    finite = bool(torch.isfinite(got).all())
    excess = torch.where(err <= tol, torch.zeros_like(err), err / tol.clamp_min(1e-300))
    if not finite:
        excess = torch.where(torch.isfinite(got), excess, torch.full_like(err, math.inf))
    worst = int(excess.argmax()) if excess.numel() else 0
    ok = finite and bool((err <= tol).all())
    return ProbeResult(probe=name, dtype=str(dtype).replace("torch.", ""), device=str(device), ok=ok,
                       max_excess=float(excess.max()), max_err=float(err.max()), worst_index=worst, seconds=dt)


class Prober:
    """Runs the probes on one device: once, on demand, or periodically in a thread.

    Meant for spare and idle devices (warm spares run it while they wait) and for
    a suspect named by a check. Every result is emitted as an ``sdc_probe``
    event on ``events`` (a :class:`resilient.events.EventLog`, or None) and kept
    in :attr:`results`; :attr:`failed` lists the failures.
    """

    def __init__(self, device: torch.device | str = "cpu", *, dtypes=("float32", "bfloat16"), matmul_n: int = 256,
                 reduce_n: int = 1 << 20, seed: int = 1234, events=None,
                 matmul: Callable = torch.matmul, reduce: Callable = fp32_sum):
        bad = [d for d in dtypes if d not in _DTYPES]
        if bad:
            raise ValueError(f"probe dtypes {bad} unknown; use {sorted(_DTYPES)}")
        self.device = torch.device(device)
        self.dtypes = [_DTYPES[d] for d in dtypes]
        self.matmul_n, self.reduce_n, self.seed = matmul_n, reduce_n, seed
        self.events, self.matmul, self.reduce = events, matmul, reduce
        self.results: list[ProbeResult] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg, device="cpu", events=None, **kw) -> "Prober":
        return cls(device, dtypes=tuple(cfg.probe_dtypes), matmul_n=cfg.probe_matmul, reduce_n=cfg.probe_reduce,
                   seed=cfg.probe_seed, events=events, **kw)

    @property
    def failed(self) -> list[ProbeResult]:
        return [r for r in self.results if not r.ok]

    def run_once(self, reason: str = "on_demand") -> list[ProbeResult]:
        """All probes in all dtypes, now, on this thread. Returns this round's results."""
        out = []
        with self._lock, torch.no_grad():
            for dt in self.dtypes:
                for name, run in (("matmul", lambda: matmul_probe(dt, self.device, self.matmul_n, self.seed, self.matmul)),
                                  ("sum", lambda: reduction_probe(dt, self.device, self.reduce_n, self.seed, self.reduce))):
                    try:
                        out.append(run())
                    except Exception as e:  # noqa: BLE001 - a kernel that fails is the finding
                        out.append(ProbeResult(probe=name, dtype=str(dt).replace("torch.", ""), device=str(self.device),
                                               ok=False, max_excess=math.inf, max_err=math.inf, worst_index=-1,
                                               seconds=0.0, error=f"{type(e).__name__}: {e}"))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.results.extend(out)
        if self.events is not None:
            for r in out:
                self.events.emit("sdc_probe", reason=reason, **asdict(r))
        return out

    def start(self, every: timedelta) -> None:
        """Probe every ``every`` in a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop():
            while not self._stop.wait(every.total_seconds()):
                self.run_once("periodic")

        self._thread = threading.Thread(target=loop, name="sdc-prober", daemon=True)
        self._thread.start()

    def stop(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout.total_seconds())
        self._thread = None
