"""Warm worker processes: ``python -m resilient.agent.warm [--zygote FD]``.

Imports torch and everything a worker needs (≈ 3-4 s on an idle core, 10-30 s
on the soak's shared 2 cores: the bulk of a cold start), then waits on stdin
for an assignment: a JSON line with the environment (rank, world size, master
address, ...) and the worker's arguments.

- Plain: the process becomes that one worker (a cold start, when the agent
  keeps no spares).
- ``--zygote FD``: the process stays a template. Each assignment is a
  ``fork()`` (~30 ms: the imports are shared, copy-on-write) whose child
  becomes the worker; the zygote reports ``started TOKEN PID`` and, when it
  reaps a child, ``exit PID CODE`` on the pipe FD. Measured in the soak: spare
  processes re-spawned after each fault were still importing when the next
  fault took them (faults every ~15 s, imports 10-30 s), so "warm" restarts
  cost 8-30 s; a zygote is warm again the moment it forked.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1

# What every worker's environment holds whatever the node's size (resilient.launch adds the
# thread count): a TCP store per attempt (torch 2.13's shared rendezvous store hands restarted
# workers the previous attempt's addresses), identical workers on every node (ranks without a
# store round trip), unbuffered output.
BASE_WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_WORKER_IDENTICAL": "1",
                   "PYTHONUNBUFFERED": "1"}


def spawn_zygote(env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """Start ``python -m resilient.agent.warm --zygote FD`` in its own process group; returns
    it and the read end of its status pipe (see :class:`resilient.agent.pool.Zygote`)."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "resilient.agent.warm", "--zygote", str(w)],
                                stdin=subprocess.PIPE, pass_fds=(w,),
                                env={**os.environ, **env, "RESILIENT_PARENT_PID": str(os.getpid())},
                                process_group=0)
    finally:
        os.close(w)
    return proc, r


_early: tuple[subprocess.Popen, int] | None = None


def start_early() -> None:
    """Start this agent's zygote now, before the agent's own imports.

    Why: a new node's agent imports torch (~2-3 s) and only then started its zygote,
    which imports torch again (~2.5 s) before the node can join: a cold replacement
    node paid both, one after the other. Started first, the two imports overlap. The
    zygote's environment lacks the thread count (it depends on the config, not read
    yet): every assignment carries the full worker environment and the worker sets
    its threads from it (:func:`resilient.worker.main`)."""
    global _early
    if _early is None:
        _early = spawn_zygote(BASE_WORKER_ENV)


def take_early() -> tuple[subprocess.Popen, int] | None:
    """The zygote :func:`start_early` started (once; None if none)."""
    global _early
    early, _early = _early, None
    return early


def wants_zygote(argv: list[str]) -> bool:
    """Will ``resilient launch ARGV`` keep spares (so a zygote)? Read from the TOML and the
    ``--set launch.spares=N`` overrides without importing the config code (which imports
    torch); anything unclear says no, and the agent starts its zygote later as before."""
    import tomllib

    try:
        config = next(a for a in argv if not a.startswith("-"))
        with open(config, "rb") as f:
            spares = tomllib.load(f).get("launch", {}).get("spares", -1)
        sets = [b for a, b in zip(argv, argv[1:]) if a == "--set"] + [a[6:] for a in argv if a.startswith("--set=")]
        for s in sets:
            if s.replace(" ", "").startswith("launch.spares="):
                spares = int(s.split("=", 1)[1])
        return int(spares) != 0
    except (StopIteration, OSError, ValueError, TypeError, tomllib.TOMLDecodeError):
        return False


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the agent dies (Linux); exit now if it
    already has. Set by the child itself: ``preexec_fn`` is unsafe in a
    parent that runs threads, as the agent does."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = os.environ.get("RESILIENT_PARENT_PID")
    if parent and os.getppid() != int(parent):
        os._exit(1)


def _preload() -> None:
    # What a worker imports on its way to the first step.
    import torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import resilient.train  # noqa: F401
    import resilient.worker  # noqa: F401
    from resilient.sdc import native

    native.library()   # the SDC kernels: built once per machine (~0.3 s), loaded here once for every fork


def _zygote(status_fd: int) -> int:
    """Fork one worker per assignment line until stdin closes (see the module docstring)."""
    import select
    import traceback

    status = os.fdopen(status_fd, "w", buffering=1)
    status.write("ready\n")
    buf = b""
    while True:
        # Reap between reads: no thread and no signal handler in a process that forks.
        while True:
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            status.write(f"exit {pid} {os.waitstatus_to_exitcode(wstatus)}\n")
        readable, _, _ = select.select([0], [], [], 0.05)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return 0  # the agent closed the pipe: its workers die with us (PDEATHSIG)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            assignment = json.loads(line)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setpgid(0, 0)  # its own group: the agent's killpg reaches it, not us
                    status.close()
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    os.close(devnull)
                    os.environ["RESILIENT_PARENT_PID"] = str(os.getppid())
                    die_with_parent()  # the zygote is the parent now; it dies with the agent
                    os.environ.update(assignment["env"])
                    from resilient.worker import main as worker_main

                    code = worker_main(assignment["argv"])
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code if isinstance(code, int) else 1)
            try:
                os.setpgid(pid, pid)  # also here: the agent may signal before the child ran
            except OSError:
                pass
            status.write(f"started {assignment['token']} {pid}\n")


def main() -> int:
    die_with_parent()
    _preload()
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        return _zygote(int(sys.argv[2]))
    line = sys.stdin.readline()
    if not line:
        return 0  # the agent closed the pipe: not needed
    assignment = json.loads(line)
    os.environ.update(assignment["env"])
    sys.stdin.close()
    from resilient.worker import main as worker_main

    return worker_main(assignment["argv"])


if __name__ == "__main__":
    sys.exit(main())
