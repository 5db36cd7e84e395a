"""``Job``: every snapshot tier, restore, preemption and SDC check for a training loop.

The few lines a script adds (see the README's "Your own script")::

    job = resilient.Job(model=model, optimizer=optimizer, state={"loader": loader})
    for step in job.steps(args.steps):            # restores first; then one iteration per step
        loss = forward_backward(step)
        if not job.verify(loss, replay=lambda: forward_backward(step)):
            continue                              # SDC rolled the state back; the loop goes on from there
        optimizer.step(); optimizer.zero_grad()

What each iteration's end (the *step boundary*) does: the at-rest SDC checks,
the worker's heartbeat, a ``step`` event in ``RUN_DIR/events.jsonl``, a
snapshot into every due tier (blocking only for the host copy), the progress
line, and on SIGTERM (a preemption notice) a final durable snapshot and the
end of the loop.

Where it runs decides the tiers:

- under ``resilient launch``: the node's RAM store, peer replicas and the
  durable tier, restore from the fastest that holds the newest version,
  heartbeats to the agent, SDC quarantine through the agent;
- under plain ``torchrun`` or ``python``: the durable tier in the run dir
  (``--run-dir`` of launch, ``run_dir=``, ``$RESILIENT_RUN_DIR``, or
  ``runs/<script name>``), said once in a warning.

Step numbers count completed optimizer steps: ``steps(n)`` yields the index
of the step about to run (0 first), a restored run starts at the restored
version, and the version saved after the body of iteration ``i`` is ``i + 1``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from resilient.contract import (HOOKS_ENV, NODE_ID_ENV, RUN_DIR_ENV, RUNTIME_CONFIG_ENV, STORE_ENV, WorkerExit,
                                 events_path, mark_clean_run_end)
from resilient.events import EventLog
from resilient.failslow.monitor import FailSlowMonitor
from resilient.job.api import (
    JobError, JobOptions, NotUnderAgent, refuse_moved_options, is_stateful, rank_state_dicts, restore_rank_state,
)
from resilient.job.guard import SdcGuard
from resilient.job.heartbeat import HeartbeatWriter
from resilient.progress import Marks, ProgressLine
from resilient.snapshot.keeper import StateKeeper
from resilient.job.modelstate import ModelState, as_list
from resilient.rundir import private_dir
from resilient.runconfig import RuntimeConfig, load_runtime_config, runtime_config_from_env
from resilient.sdc.api import Action, Decision
from resilient.sdc.checksums import local as _local
from resilient.snapshot import Restored, rng_state, set_rng_state
from resilient.snapshot.api import StorageError



class InitialState:
    """The state a fresh run started from, to go back to when an SDC rollback finds no version
    yet: a host copy of this rank's parameters (local shards), the optimizers as they were
    (no state, or the zeros made up front), the job's other state, this rank's state and
    RNG streams. (Saving a version at start instead would make a fresh optimizer's state
    early: torch's ``get_state_dict`` takes an optimizer step to make it.)"""

    def __init__(self, job: "Job"):
        self.job = job
        ms = job.model_state
        self.params = [(p, _local(p).detach().to("cpu", copy=True)) for m in ms.modules for p in m.parameters()]
        self.optimizers = [(o, not o.state) for o in ms.optimizers if o is not None]
        # hyperparameters a scheduler changes (lr): JSON-like values, tensors cloned
        self.groups = [[{k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                         for k, v in g.items() if k != "params"} for g in o.param_groups] for o, _ in self.optimizers]
        self.extra = {k: copy.deepcopy(v.state_dict() if is_stateful(v) else v) for k, v in job.extra_state.items()
                      if not isinstance(v, torch.Tensor)}
        self.tensors = {k: v.detach().clone() for k, v in job.extra_state.items() if isinstance(v, torch.Tensor)}
        self.rank = rank_state_dicts(job.rank_state)
        self.rng = rng_state(job.generators)

    @torch.no_grad()
    def __call__(self) -> None:
        for p, saved in self.params:
            _local(p).copy_(saved)
        for (opt, was_empty), groups in zip(self.optimizers, self.groups):
            for live, saved in zip(opt.param_groups, groups):
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor):
                        live[k].copy_(v)
                    else:
                        live[k] = copy.deepcopy(v)
            if was_empty:
                opt.state.clear()
                continue
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
        job = self.job
        restore_rank_state(job.extra_state, copy.deepcopy(self.extra))   # the same three kinds of value
        for k, saved in self.tensors.items():
            job.extra_state[k].copy_(saved)
        restore_rank_state(job.rank_state, self.rank)
        set_rng_state(self.rng, job.generators)


def default_run_dir() -> Path:
    """``$RESILIENT_RUN_DIR``, else ``runs/<script name>`` under the working directory."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "job"
    return Path("runs") / (script or "job")


def param_digest(named_parameters) -> str:
    """SHA-256 of this rank's local parameter bytes, in name order: equal digests on every
    rank of two runs of one layout = bitwise-equal models."""
    h = hashlib.sha256()
    for name, p in sorted(named_parameters, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(_local(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def committed_text(step: int, tiers: dict[str, int], snap) -> str:
    """The progress line's "committed" field: the newest step per tier, each marked
    ``(stale)`` when it lags the step by more than two of its intervals plus one (commits
    are asynchronous: one interval behind is normal), e.g. a node store that filled up
    or a durable store that cannot keep up: training goes on, with that tier behind."""
    every = {"local": snap.every, "peer": snap.every * max(1, snap.replicate_max_stride), "durable": snap.durable_every}
    out = []
    for t in ("local", "peer", "durable"):
        if t in tiers:
            stale = every[t] > 0 and step - tiers[t] > 2 * every[t] + 1
            out.append(f"{t} {tiers[t]}" + (" (stale)" if stale else ""))
    return " ".join(out) or "none yet"


class Job:
    """The runtime's services for one training process; see the module docstring.

    - ``model``, ``optimizer``: a module and its optimizer, or lists of them (pipeline
      stages, one optimizer per module; None for a module without one). Saved through
      torch's state-dict API with global names; FSDP2/TP shards reshard on restore.
    - ``state``: more of the run's state, saved once for the job: ``Stateful`` objects
      (``state_dict()``/``load_state_dict()``: an LR scheduler), tensors and DTensors, JSON
      values (counters) — a dict is restored in place, a plain value comes back in
      ``job.extra_state[key]``.
    - ``rank_state``: state of this rank alone (a per-rank data loader, its RNG): JSON or
      ``Stateful`` with a JSON state dict. Restored on a rank of the same number when the
      world size did not change; after a resize it stays as built (``resharded`` is True).
    - ``config``: the runtime config (a :class:`RuntimeConfig`, a TOML path, or None: the
      one ``resilient launch`` resolved, else the defaults).
    - ``progress``: rank 0's live line (step, loss, tokens/s, committed versions); False: none.
    - ``options``: for trainers that know more (:class:`~resilient.job.api.JobOptions`: the
      parallel layout, the model config's digest, generators, ...).
    """

    def __init__(self, model: nn.Module | list | None = None, optimizer: Any = None, *,
                 state: Mapping[str, Any] | None = None, rank_state: Mapping[str, Any] | None = None,
                 run_dir: str | os.PathLike | None = None, config: RuntimeConfig | str | os.PathLike | None = None,
                 progress: bool = True, options: JobOptions | None = None, **moved: Any):
        refuse_moved_options(moved)   # the keywords that became options name their replacement
        opts = options or JobOptions()
        self.startup: dict[str, float] = {}
        mark = Marks(self.startup)
        self.config = self._config(config)
        self.under_agent = bool(os.environ.get(STORE_ENV) or os.environ.get(RUNTIME_CONFIG_ENV))
        self.run_dir = (Path(run_dir) if run_dir is not None else default_run_dir()).resolve()
        private_dir(self.run_dir)   # 0700 when made here; another user's is refused (resilient.rundir)
        self.node = opts.node or os.environ.get(NODE_ID_ENV) or None
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise JobError("WORLD_SIZE > 1 but no process group: call torch.distributed.init_process_group() "
                           "before creating the Job")
        else:
            self.rank, self.world_size = 0, 1
        self.events = EventLog(events_path(self.run_dir), node=self.node, rank=self.rank)
        if not self.under_agent and self.rank == 0:
            warnings.warn(NotUnderAgent.MESSAGE.format(run_dir=self.run_dir), NotUnderAgent, stacklevel=2)
        self.modules = as_list(model)
        optimizers = as_list(optimizer)
        if self.modules and not optimizers:
            optimizers = [None] * len(self.modules)
        self.model_state = ModelState(self.modules, optimizers, param_groups=opts.param_groups) if self.modules else None
        self.extra_state = dict(state or {})
        taken = {"model", "optim"} & set(self.extra_state) if self.model_state is not None else set()
        if taken:
            raise JobError(f"state key(s) {sorted(taken)} are taken by the model's and optimizer's state; rename them")
        self.rank_state = dict(rank_state or {})
        self.generators = dict(opts.generators or {})
        self.layout = dict(opts.layout or {"world": self.world_size})
        self.run_info, self.reinit, self.fresh_model = opts.run_info, opts.reinit, opts.fresh_model
        self.describe = dict(opts.describe or {})
        self.device = opts.device or (self._first_param_device() or torch.device("cpu"))
        if self.model_state is not None:
            # a restore needs the optimizer's tensors to fill; made now where that changes
            # nothing (Adam: zeros, step 0, packed for the at-rest hashes), else before a restore
            self.model_state.materialize(fallback=False)
        mark("optimizer_state")
        self.keeper = StateKeeper(self.config.snapshot, self.run_dir, self._snapshot_state, self._load_state,
                                  self.events, layout=self.layout, config_digest=opts.config_digest)
        self.startup.update({f"snapshots.{k}": v for k, v in self.keeper.setup_timings.items()})
        self.guard = SdcGuard(self.config.sdc, self.modules, optimizers, events=self.events, device=self.device,
                              rank=self.rank, world=self.world_size, node=self.node or "",
                              local_rank=int(os.environ.get("LOCAL_RANK", "0")), watch_fsdp=opts.watch_fsdp,
                              post_scale=opts.post_scale, run_dir=self.run_dir)
        mark("sdc")
        self.heartbeat = HeartbeatWriter.from_env()
        self.step = 0              # completed steps; the next one to run is self.step
        self.restored: Restored | None = None
        self.resharded = False     # the restored version was written by another layout
        self.stop_requested = False   # this rank or another was told to stop (they agree: _stop_agreed)
        self.signalled = False        # this process was (a SIGTERM reached it)
        self.loss: float | None = None
        self.last_local_loss: Any = None
        self._fields: dict[str, Any] = {}
        self._restored_once = False
        self._broke = False        # the loop was left with break/return: close() finishes it
        self._leaving = False      # a quarantine sends this worker away: nothing more is saved
        self._finished = False
        self._rolled_back = False
        self._t_step = time.perf_counter()
        self._last_step_seconds = 0.0   # the last completed step's time: the cross-check's budget is a share of it
        self.progress = ProgressLine(0, every=opts.log_every) if progress and self.rank == 0 else None
        self._install_sigterm()
        # Ranks agree on a preemption's last step over gloo (a CPU tensor whatever the device
        # backend): the signal reaches each worker at its own point of a step, and a rank that
        # stopped a step earlier than the others would leave them in a collective.
        self._stop_group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        # ... which the fail-slow monitor runs, telling every rank when rank 0 found a straggler
        self.failslow = FailSlowMonitor(self.config.failslow, group=self._stop_group, rank=self.rank,
                                        world=self.world_size, node=self.events.node, events=self.events,
                                        device=self.device, trace=self.run_dir / "failslow-trace.jsonl",
                                        keep_alive=lambda bound: self.heartbeat.while_waiting(limit=bound))
        self.hooks = self._load_hooks()
        if opts.startup:   # what the trainer timed before the Job leads run_start's phases
            self.startup = {**opts.startup, **self.startup}

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _config(config) -> RuntimeConfig:
        if isinstance(config, RuntimeConfig):   # a trainer's whole config may extend it (the GPT's)
            return config
        if config is not None:
            return load_runtime_config(config)
        return runtime_config_from_env() or RuntimeConfig()

    def _first_param_device(self) -> torch.device | None:
        for m in self.modules:
            for p in m.parameters():
                return _local(p).device
        return None

    def _install_sigterm(self) -> None:
        # Preemption notice: finish the step in flight, save it, leave. Only the main thread
        # may set handlers; a loop run elsewhere relies on its process's own handling.
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = self.signalled = True

    def _load_hooks(self) -> list:
        """The public extension point for worker-side tools (the chaos harness): each
        ``module:attr`` in ``$RESILIENT_WORKER_HOOKS`` (comma-separated) is called with this
        job and may return an object with ``close()``."""
        hooks = []
        for spec in filter(None, (s.strip() for s in os.environ.get(HOOKS_ENV, "").split(","))):
            module, _, attr = spec.partition(":")
            target: Any = importlib.import_module(module)
            for part in attr.split(".") if attr else []:
                target = getattr(target, part)
            hook = target(self)
            if hook is not None:
                hooks.append(hook)
        return hooks

    # ----------------------------------------------------------------- state
    @property
    def model(self):
        """The modules as one object for name look-ups (``named_parameters``, ``named_modules``)."""
        return self.guard.view

    @property
    def sdc(self):
        """The :class:`~resilient.sdc.monitor.SdcMonitor` (None with ``[sdc] enable = false``):
        register more checks on it, e.g. ``watch_replicas`` for tensors your layout replicates."""
        return self.guard.monitor

    @property
    def flips(self) -> list:
        """The bit-flip injectors (``[sdc] inject``); extension hooks may add to it."""
        return self.guard.flips

    def _snapshot_state(self) -> dict:
        out: dict = dict(self.model_state.state_dict()) if self.model_state is not None else {}
        for k, v in self.extra_state.items():
            out[k] = v.state_dict() if is_stateful(v) else v
        return out

    def _load_state(self, state: dict) -> None:
        if self.model_state is not None:
            self.model_state.load_state_dict(state)
        for k, v in self.extra_state.items():
            if is_stateful(v):
                v.load_state_dict(state[k])
            elif not isinstance(v, (dict, torch.Tensor)):
                self.extra_state[k] = state[k]   # a plain JSON value: read it back from job.extra_state

    def _materialize(self) -> None:
        if self.model_state is not None:
            self.model_state.materialize()

    def _rank_extra(self) -> dict:
        return {"rng": rng_state(self.generators), "rank_state": rank_state_dicts(self.rank_state)}

    def _global_extra(self, step: int) -> dict:
        info = dict(self.run_info(step)) if self.run_info is not None else {}
        return {"step": step, **info}

    # --------------------------------------------------------------- restore
    def restore(self) -> int:
        """Load the newest committed version from the fastest tier that holds it, resharded to
        this layout, every byte verified; returns the step to resume from (0: a fresh run).
        Collective: every rank calls it. :meth:`steps` calls it first if you did not."""
        if self._restored_once:
            return self.step
        self._restored_once = True
        t0 = time.perf_counter()
        restored = self.keeper.restore(fresh=self.fresh_model, before=self._materialize)
        self.startup["restore" if restored is not None else "init"] = round(time.perf_counter() - t0, 4)
        self.startup.update({f"restore.{k}": v for k, v in self.keeper.timings.items()})
        if restored is not None:
            self._after_restore(restored)
            # the durable version due at this step, if the lost run had not uploaded it yet
            self.keeper.catch_up(self.step, self._rank_extra, lambda: self._global_extra(self.step))
            if self.progress:
                self.progress.message(f"restored step {restored.step} from {restored.url} "
                                      f"({'resharded, ' if restored.resharded else ''}{time.perf_counter() - t0:.2f}s)")
        else:
            if self.reinit is not None and self.fresh_model:
                self.reinit()
            if self.guard.monitor is not None and self.reinit is None and self.model_state is not None:
                # A rollback before the first snapshot needs the initial state to go back to: a
                # host copy of this rank's parameters (saving a version now would make a fresh
                # optimizer's state early: torch's get_state_dict takes a step to make it).
                self.reinit = InitialState(self)
        self.guard.note_restored(self.step)
        return self.step

    def _after_restore(self, restored: Restored) -> None:
        self.restored, self.step = restored, restored.step
        self.resharded = bool(restored.resharded) or restored.world != self.world_size
        if restored.extra is not None:
            set_rng_state(restored.extra["rng"], self.generators)
            if restored.world == self.world_size:
                restore_rank_state(self.rank_state, restored.extra.get("rank_state") or {})

    # ------------------------------------------------------------ the loop
    def steps(self, until: int, total: int | None = None) -> Iterator[int]:
        """Yield the index of each step to run until ``until`` steps completed or a
        preemption; restores first. After each iteration's body: the step boundary (module
        docstring). At the end: a final durable snapshot (:meth:`finish`). ``total``: the
        run's length, when this launch stops earlier (for the progress line)."""
        self.restore()
        self.failslow.total_steps = total or until
        if self.progress:
            self.progress.total = total or until
        self._run_start(total or until)
        self.heartbeat.beat()
        try:
            while self.step < until and not self._stop_agreed():
                self.guard.begin_step(self.step)
                self._rolled_back, self._fields, self.loss = False, {}, None
                self._t_step = time.perf_counter()
                yield self.step
                if self._rolled_back:
                    continue
                self.end_step()
        except GeneratorExit:
            # the loop was left early: ``break``/``return``, or an exception once it was handled
            # (a quarantine's exit sets _leaving; a failing process closes with failed=True)
            self._broke = True
            raise
        self.finish()

    def _stop_agreed(self) -> bool:
        """Whether any rank was told to stop (SIGTERM): one small all-reduce per step, so every
        rank ends after the same step."""
        if self._stop_group is None:
            return self.stop_requested
        agreed = self.failslow.exchange(self.stop_requested, self.step)
        if agreed:   # never cleared here: a signal during the exchange counts next time
            self.stop_requested = True
        return agreed

    def phase(self, name: str):
        """``with job.phase("data"):`` around what the step spends loading data (or ``"wait"``
        around waits the runtime cannot see, e.g. DDP's C++ reducer or a device-side NCCL
        wait): the fail-slow checks tell a slow device from a slow link and a slow loader by
        where the step's time went. Collectives are timed without it."""
        return self.failslow.phase(name)

    def _run_start(self, total: int) -> None:
        sampled = self.guard.sampled_checks()   # the checks of what devices compute, at the budget's period
        self.events.emit("run_start", layout=self.layout, start_step=self.step, total_steps=total,
                         device=str(self.device), startup=self.startup, tiers=self.tiers(),
                         sdc=self.guard.coverage, **sampled, **self.describe)
        if self.rank == 0 and self.progress:
            for line in sampled.values():
                print(f"resilient: sdc {line}", file=sys.stderr, flush=True)

    def tiers(self) -> list[str]:
        """The tiers this job writes: ``memory`` (node RAM, peers) and/or ``durable``."""
        return [t for t, w in (("memory", self.keeper.memory), ("durable", self.keeper.durable)) if w is not None]

    def verify(self, loss: Any = None, replay: Callable[[], Any] | None = None, *,
               batch: Sequence[torch.Tensor] | None = None, recompute: Callable[..., Any] | None = None) -> bool:
        """After backward, before the optimizer step: the SDC checks of this step's gradients.

        ``replay()`` recomputes the step's forward and backward (same batch) and returns its
        loss: a suspect step is replayed; a different answer is a transient fault (the
        replayed gradients are used), the same wrong answer a bad device. Returns False when
        the checks rolled the state back to the last verified version: skip the optimizer
        step (``continue``); the loop resumes from the restored step. A confirmed bad device
        on this rank ends the process with the exit code that makes its agent quarantine
        the node. Also records ``loss`` for the step event.

        ``batch`` (this step's input tensors, the same shapes on every rank) and
        ``recompute(*batch)`` (the loss of a batch, as the training forward computes it,
        run without gradients) enable the sampled cross-device replay
        (:mod:`resilient.sdc.crosscheck`): on a sampled step every rank recomputes its
        neighbour's loss and the answers are compared bitwise."""
        if batch is not None and recompute is not None:
            self.guard.cross_check(self.step + 1, loss, batch, recompute, self._last_step_seconds
                                   or time.perf_counter() - self._t_step)
        loss, decision = self.guard.after_backward(self.step + 1, loss, replay)
        self.last_local_loss = loss   # replayed or not: the one this step's gradients came from
        self.record(loss=loss)
        if decision.action in (Action.ROLLBACK, Action.QUARANTINE):
            self._rollback(decision)
            return False
        return True

    def record(self, loss: Any = None, **fields: Any) -> None:
        """Fields of this step's ``step`` event (``loss`` at full precision, anything JSON)."""
        if loss is not None:
            self.loss = float(loss.detach().double()) if isinstance(loss, torch.Tensor) else float(loss)
        self._fields.update(fields)

    def end_step(self) -> None:
        """The step boundary after a completed optimizer step (``steps()`` calls it; call it
        yourself in a loop of your own, after ``optimizer.step()``)."""
        step = self.step + 1
        self.guard.settle()   # an evaluation in the body may have left FSDP2's parameters gathered
        decision = self.guard.after_optimizer_step(step)
        if decision.action in (Action.ROLLBACK, Action.QUARANTINE):
            self._rollback(decision)
            return
        if self.guard.last_verified is not None:
            self.keeper.keep_verified(self.guard.last_verified)
        self.step = step
        self.heartbeat.beat()
        seconds = self._last_step_seconds = time.perf_counter() - self._t_step
        loss = self.loss
        if self.guard.monitor is not None and self.guard.monitor.loss_mean is not None:
            loss = self.guard.monitor.loss_mean   # the checks' exchange already averaged it over ranks
        fields = {"seconds": seconds, **self._fields}
        self.events.emit("step", step=step, loss=loss, **fields)
        with self.failslow.phase("snapshot"):
            self.keeper.after_step(step, self._rank_extra, lambda: self._global_extra(step))
        if self.progress:
            if self.progress.due(step):
                self.progress.set("committed", committed_text(step, self.keeper.committed(), self.keeper.intervals()))
                if self.keeper.auto is not None:   # snapshot intervals chosen as the job runs
                    self.progress.set("every", self.keeper.interval_text())
            self.progress.update(step, loss if loss is not None else float("nan"), fields.get("tokens_per_s"),
                                 fields.get("mfu"), seconds=fields["seconds"])
        self._t_step = time.perf_counter()

    def _rollback(self, decision: Decision) -> None:
        """Corruption was confirmed during step ``self.step + 1``: nothing of it was saved (the
        checks run before its snapshot), so the newest verified version is clean. Load it and
        go on from there; a quarantine sends this rank's (or every) worker away instead."""
        self._rolled_back = True
        for opt in self.guard.optim.optimizers:
            opt.zero_grad(set_to_none=True)
        self.keeper.wait_idle()
        if decision.action is Action.QUARANTINE:
            # A bad device: its worker leaves with the exit code that tells its agent to
            # quarantine the node; everyone else leaves too, so the agents re-form without that
            # node and every rank restores the last clean version: the newer ones are gone
            # before anyone leaves (the barrier), so none can be restored.
            if decision.rollback_to is not None:
                self.keeper.abandon_after(decision.rollback_to)
            if self.rank in decision.quarantine:   # before the barrier: see HeartbeatWriter.mark_quarantine
                self.heartbeat.mark_quarantine()
            if dist.is_initialized():
                dist.barrier()
            self._leaving = True
            raise SystemExit(WorkerExit.QUARANTINE if self.rank in decision.quarantine else 1)
        restored = self.keeper.restore(max_step=decision.rollback_to, before=self._materialize)
        if restored is not None:
            self._after_restore(restored)
        else:
            if self.reinit is None:
                raise JobError("an SDC rollback found no version to go back to and the job has no reinit()")
            self.reinit()
            self.step = 0
        self.keeper.abandon_after(self.step)
        self.events.emit("rollback", to_step=self.step, reason=decision.action.value,
                         suspects=sorted({s.rank for s in decision.suspicions}))
        self.guard.note_restored(self.step)

    # ------------------------------------------------------------------ end
    def committed(self) -> dict[str, int]:
        """The newest committed step per tier this process can see."""
        return self.keeper.committed()

    def finish(self) -> None:
        """Make the last step durable (end of run, preemption); ``run_end`` event. Raises
        SystemExit with the agent's "not durable" code when it could not be saved."""
        self._finished = True
        if self.progress:
            self.progress.close()
        self.guard.settle()
        with self.heartbeat.while_waiting():
            try:
                self.keeper.final(self.step, self._rank_extra, lambda: self._global_extra(self.step))
            except StorageError as e:
                self.events.emit("worker_error", error=f"{type(e).__name__}: {e}", traceback="")
                raise SystemExit(WorkerExit.NOT_DURABLE) from e
        mark_clean_run_end(self.step)   # saved: a peer's leaving from here on is no worker error
        if self.stop_requested and not self.signalled and os.environ.get(NODE_ID_ENV):
            # Stopped for another node's preemption: saved with it; this node stays, and its
            # agent re-forms the job without the leaver (WorkerExit.PEER_LEFT: not a failure). A
            # fail-slow replace stops every rank the same way; the slow node's leave with
            # WorkerExit.SLOW, so their agent marks the node and hands its seat over.
            slow = self.failslow.replacing
            self.events.emit("run_end", step=self.step, preempted=slow is None, peer_left=True,
                             **({"replaced": slow["slow_node"]} if slow else {}))
            raise SystemExit(WorkerExit.SLOW if self.failslow.leaving else WorkerExit.PEER_LEFT)
        if self.stop_requested:
            # A stop the agent decided (an etcd outage, say) is said as such, not as a preemption.
            ours = self.heartbeat.stop_reason()
            self.events.emit("run_end", step=self.step, preempted=ours is None, **({"stopped": ours} if ours else {}))
            if self.rank == 0:   # what the stop did, in one line of ours
                where = self.keeper.durable.url if self.keeper.durable is not None else "nowhere durable"
                what = f"stopped by its agent ({ours})" if ours else "preempted"
                print(f"resilient: {what} after step {self.step}: saved in {' and '.join(self.tiers())} "
                      f"({where}); a relaunch resumes from step {self.step}", file=sys.stderr, flush=True)
        else:
            digest = param_digest(self.guard.view.named_parameters()) if self.modules else None
            self.events.emit("run_end", step=self.step, param_digest=digest)

    def close(self, failed: bool = False) -> None:
        """Finish in-flight writes and stop the checks. ``failed``: the process is failing
        (bounded waits; nothing that needs every rank). A loop left early (``break`` out of
        :meth:`steps`) is finished here first: its last completed step is made durable."""
        if not failed and self._broke and not self._finished and not self._leaving:
            self.finish()
        for hook in self.hooks:
            hook.close()
        self.failslow.close(failed)
        with self.heartbeat.while_waiting():
            self.keeper.close(failed)
            self.guard.close()
        self.events.close()
        if (self._old_sigterm is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm):   # not another Job's since
            signal.signal(signal.SIGTERM, self._old_sigterm)   # the process lives on (a test, a notebook)
            self._old_sigterm = None

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        failed = exc_type is not None and not (exc_type is SystemExit and exc is not None and exc.code in (0, None))
        self.close(failed=failed)
