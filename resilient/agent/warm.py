"""Warm worker processes: ``python -m resilient.agent.warm [--zygote FD]``.

Imports torch (≈ 3-4 s on an idle core, 10-30 s on the soak's shared 2 cores:
the bulk of a cold start), reads the program's *setup* line on stdin (the
modules its workers import on their way to the first step, imported here
once), then waits on stdin for an assignment: a JSON line with the
environment (rank, world size, master address, ...), the *entry module* and
its arguments. The worker is ``ENTRY.main(argv)``: the runtime names no
trainer; the launcher says what its workers run (:mod:`resilient.launch`:
the built-in GPT's worker, or :mod:`resilient.agent.script` for a user's
script).

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
import importlib
import json
import os
import signal
import subprocess
import sys

from resilient.contract import PARENT_PID_ENV, SCRIPT_ENTRY

_PR_SET_PDEATHSIG = 1

# What every worker's environment holds whatever the node's size (resilient.launch adds the
# thread count): a TCP store per attempt (torch 2.13's shared rendezvous store hands restarted
# workers the previous attempt's addresses), identical workers on every node (ranks without a
# store round trip), unbuffered output.
BASE_WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCH_ELASTIC_WORKER_IDENTICAL": "1",
                   "PYTHONUNBUFFERED": "1"}


def setup_line(preload: list[str] | tuple[str, ...]) -> bytes:
    """The first line a warm process reads: what to import before it is ready.
    Each item is a module (``torch.distributed.fsdp``) or ``module:function`` to
    import and call once (e.g. to load a native library every fork then shares)."""
    return (json.dumps({"preload": list(preload)}) + "\n").encode()


def spawn_zygote(env: dict[str, str], preload: list[str] | tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """Start ``python -m resilient.agent.warm --zygote FD`` in its own process group, told
    to import ``preload``; returns it and the read end of its status pipe (see
    :class:`resilient.agent.pool.Zygote`)."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "resilient.agent.warm", "--zygote", str(w)],
                                stdin=subprocess.PIPE, pass_fds=(w,),
                                env={**os.environ, **env, PARENT_PID_ENV: str(os.getpid())},
                                process_group=0)
    finally:
        os.close(w)
    proc.stdin.write(setup_line(preload))  # a pipe buffers it until the zygote reads
    proc.stdin.flush()
    return proc, r


_early: tuple[subprocess.Popen, int] | None = None


def start_early(preload: list[str] | tuple[str, ...] = ()) -> None:
    """Start this agent's zygote now, before the agent's own imports.

    Why: a new node's agent imports torch (~2-3 s) and only then started its zygote,
    which imports torch again (~2.5 s) before the node can join: a cold replacement
    node paid both, one after the other. Started first, the two imports overlap. The
    zygote's environment lacks the thread count (it depends on the config, not read
    yet): every assignment carries the full worker environment and the forked child
    sets its threads from it (:func:`_become_worker`)."""
    global _early
    if _early is None:
        _early = spawn_zygote(BASE_WORKER_ENV, preload)


def take_early() -> tuple[subprocess.Popen, int] | None:
    """The zygote :func:`start_early` started (once; None if none)."""
    global _early
    early, _early = _early, None
    return early


# Options of `resilient launch` that take no value (every other --option takes one):
# how wants_zygote finds the SCRIPT or CONFIG without importing the launcher's parser.
# tests/unit/config/test_launch_script_args.py checks this against resilient.launch's parser.
LAUNCH_FLAGS = frozenset({"-h", "--help", "-m", "--module", "--standalone"})


def _launch_target(argv: list[str]) -> tuple[str | None, int]:
    """(the first positional of ``resilient launch ARGV``: SCRIPT, MODULE or CONFIG.toml, and
    its index); (None, len(argv)) when there is none."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return (argv[i + 1], i + 1) if i + 1 < len(argv) else (None, len(argv))
        if not a.startswith("-") or a == "-":
            return a, i
        i += 1 if (a in LAUNCH_FLAGS or "=" in a) else 2
    return None, len(argv)


def wants_zygote(argv: list[str]) -> bool:
    """Will ``resilient launch ARGV`` keep spares (so a zygote)? Read from the TOML (the GPT's
    run config, or a script's ``--config``) and the ``--set launch.spares=N`` overrides before
    the script, without importing the config code (which imports torch); anything unclear
    says no, and the agent starts its zygote later as before."""
    import tomllib

    target, at = _launch_target(argv)
    is_script = target is not None and not target.endswith(".toml")
    opts = argv[:at] if is_script else argv  # what follows a script is the script's own
    pairs = list(zip(opts, opts[1:]))
    try:
        if target is None:
            return False
        config = target
        if is_script:  # a script's runtime knobs are in its --config, if any
            given = [b for a, b in pairs if a == "--config"] + [a[9:] for a in opts if a.startswith("--config=")]
            config = given[0] if given else None
        spares = -1
        if config is not None:
            with open(config, "rb") as f:
                spares = tomllib.load(f).get("launch", {}).get("spares", -1)
        sets = [b for a, b in pairs if a == "--set"] + [a[6:] for a in opts if a.startswith("--set=")]
        for s in sets:
            if s.replace(" ", "").startswith("launch.spares="):
                spares = int(s.split("=", 1)[1])
        return int(spares) != 0
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError):
        return False


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the agent dies (Linux); exit now if it
    already has. Set by the child itself: ``preexec_fn`` is unsafe in a
    parent that runs threads, as the agent does."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and os.getppid() != int(parent):
        os._exit(1)


def _preload(items: list[str]) -> None:
    """Import what the program's workers import on their way to the first step. A failing
    item is reported and skipped: the worker meets the same error itself, with its own
    traceback, where the agent can see it."""
    for item in items:
        module, _, function = item.partition(":")
        try:
            mod = importlib.import_module(module)
            if function:
                getattr(mod, function)()
        except Exception as e:
            print(f"resilient.agent.warm: preloading {item} failed ({type(e).__name__}: {e}); "
                  "the workers will import it themselves", file=sys.stderr)


class _Lines:
    """JSON lines from stdin (fd 0), read with os.read: the zygote polls fd 0 with select,
    so nothing may sit in a Python-level buffer."""

    def __init__(self):
        self.buf = b""
        self.closed = False

    def pop(self) -> dict | None:
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def read(self) -> bool:
        chunk = os.read(0, 1 << 16)
        self.closed = not chunk
        self.buf += chunk
        return bool(chunk)

    def next_blocking(self) -> dict | None:
        """The next line; None once stdin is closed."""
        while (item := self.pop()) is None:
            if self.closed or not self.read():
                return None
        return item


def _empty_stdin() -> None:
    """A worker's stdin is /dev/null, not the agent's pipe (which says when to exit)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _become_worker(assignment: dict) -> int:
    """Run ``ENTRY.main(argv)`` in this process with the assignment's environment."""
    os.environ.update(assignment["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        # torch was imported before the thread count was known (a zygote started early, or a
        # cold process started before the config was read): set it here, where it is.
        import torch

        torch.set_num_threads(int(threads))
    entry = importlib.import_module(assignment.get("entry") or SCRIPT_ENTRY)
    return entry.main(assignment["argv"])


def _zygote(status_fd: int, lines: _Lines) -> int:
    """Fork one worker per assignment line until stdin closes (see the module docstring)."""
    import select
    import traceback

    status = os.fdopen(status_fd, "w", buffering=1)
    status.write("ready\n")
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
        assignment = lines.pop()
        if assignment is None:
            readable, _, _ = select.select([0], [], [], 0.05)
            if readable and not lines.read():
                return 0  # the agent closed the pipe: its workers die with us (PDEATHSIG)
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)  # its own group: the agent's killpg reaches it, not us
                status.close()
                _empty_stdin()
                os.environ[PARENT_PID_ENV] = str(os.getppid())
                die_with_parent()  # the zygote is the parent now; it dies with the agent
                code = _become_worker(assignment)
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
    import torch  # noqa: F401  (what every worker imports first: the bulk of a cold start)

    lines = _Lines()
    setup = lines.next_blocking()
    if setup is None:
        return 0  # the agent closed the pipe: not needed
    _preload(setup.get("preload", []))
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        code = _zygote(int(sys.argv[2]), lines)
        # The zygote opened nothing of its own to close: it ends without the teardown of
        # torch and the preloaded modules, which its agent waited for at every run's end
        from resilient.procs import exit_without_teardown

        exit_without_teardown(code)
    assignment = lines.next_blocking()
    if assignment is None:
        return 0  # the agent closed the pipe: not needed
    _empty_stdin()
    return _become_worker(assignment)


if __name__ == "__main__":
    sys.exit(main())
