"""Benchmark-only hook: switch snapshots and SDC checks on and off per block of steps
inside one running ``resilient launch`` job (bench/bench_overhead.py).

Why: on a shared 2-core machine two separate runs differ by far more than the
2% (snapshots + replication) and 1% (SDC) goals; blocks of each mode
interleaved in the *same* worker processes, compared pairwise, cancel most of
that. bench_overhead.py puts this folder first on PYTHONPATH and sets
``RESILIENT_BENCH_BLOCKS=WARMUP:BLOCK:MODE,MODE,...``; Python imports this
``sitecustomize`` at start-up in every process of the job. It does nothing
unless that variable is set, and then only wraps three methods once
``resilient.gpt.train`` is imported (in the workers):

- ``StateKeeper.after_step`` skips the capture (node store, hence replication)
  for steps whose mode has no ``snap``;
- ``VersionAuth.chunk_mac`` skips the chunks' AES-GMAC for versions of steps whose mode
  has ``nomac`` (``snap+nomac``: snapshots with the chunk MACs off, beside ``snap``);
- ``Trainer.train_step`` detaches the SDC monitor (and disarms its
  reduce-scatter sums) for steps whose mode has no ``sdc``; when checks resume
  after a pause, the monitor is told the parameters moved (``note_restored``),
  exactly as after a restore, so its at-rest hashes do not see a false fault.

Mode of step s (completed-step numbering, the first step is 1): steps up to
WARMUP run with everything on; then blocks of BLOCK steps cycle through the
modes, the order rotated by one each cycle so every mode takes every position.
The schedule lives in ``resilient_bench_blocks`` beside this file, imported by
bench_overhead.py too, so both sides agree.
"""

from __future__ import annotations

import os
import sys

from resilient_bench_blocks import ENV, mode_of  # noqa: E402  (this folder is on sys.path)


def _patch(train) -> None:
    spec = os.environ[ENV]
    from resilient.snapshot import keeper

    def wants(step: int, what: str) -> bool:
        m = mode_of(step, spec)
        return m is None or what in m.split("+")

    after_step = keeper.StateKeeper.after_step

    def after_step_blocks(self, step: int, extra, global_extra, force: bool = False) -> None:
        if force or wants(step, "snap"):
            after_step(self, step, extra, global_extra, force)

    train_step = train.Trainer.train_step

    def train_step_blocks(self, step: int):
        guard = self.job.guard
        mon = self.__dict__.setdefault("_bench_sdc", guard.monitor)
        if mon is not None:
            on = wants(step + 1, "sdc")
            if on and guard.monitor is None:
                mon.note_restored(step)  # the parameters moved while unchecked
            guard.monitor = mon if on else None
            every = mon.cfg.check_every
            for chk in mon.reductions:
                chk.arm(on and every > 0 and (step + 1) % every == 0)
        return train_step(self, step)

    from resilient.snapshot import auth

    chunk_mac = auth.VersionAuth.chunk_mac

    def chunk_mac_blocks(self, step: int, attempt: str, raw, nonce=None) -> str:
        # ``nomac`` blocks: the version's chunks carry a tag of the right form, not computed
        # (the per-byte AES-GMAC pass skipped; nothing reads these versions back in the bench)
        m = mode_of(step, spec)
        if m is not None and "nomac" in m.split("+"):
            return auth.CHUNK_MAC + "0" * (2 * (auth.NONCE + auth.TAG))
        return chunk_mac(self, step, attempt, raw, nonce)

    keeper.StateKeeper.after_step = after_step_blocks
    train.Trainer.train_step = train_step_blocks
    auth.VersionAuth.chunk_mac = chunk_mac_blocks


class _Finder:
    """Wraps the loader of ``resilient.gpt.train`` so the patch runs right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name != "resilient.gpt.train":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            try:
                _patch(module)
            except Exception as e:   # said where the job's log shows it; bench_overhead also checks the modes took
                print(f"overhead hook: could not switch modes ({type(e).__name__}: {e}); every block runs "
                      "everything on", file=sys.stderr, flush=True)
                raise

        spec.loader.exec_module = exec_and_patch
        return spec


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if the interpreter has one (Debian's does)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
if os.environ.get(ENV):
    sys.meta_path.insert(0, _Finder())
