"""deploy/slurm/resilient.sbatch submitted for real: a private one-node Slurm cluster
(munged, slurmctld, slurmd from Debian's slurm-wlm, on free ports with a throwaway
config and key), an external etcd, two agents on the node acting as two nodes.

Skips, saying why, where Slurm is not installed (scripts/test installs it) or the
daemons cannot run (they need root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

from launchutil import REPO
from resilient.etcd.server import free_port
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.procs import kill_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SBATCH = REPO / "deploy" / "slurm" / "resilient.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch")
JOB_TIMEOUT = timedelta(seconds=120)


def _unavailable() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; `apt-get install slurm-wlm`)"
    if os.geteuid() != 0:
        return "a private slurmd runs jobs as root here: needs root"
    return None


pytestmark.append(pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or ""))

CONF = """\
ClusterName=rtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture
def slurm():
    """A private Slurm cluster of this one machine; yields the environment its commands need.
    Its directory is not under pytest's tmp_path: munged wants every directory above its
    socket searchable by all, and pytest's are private (0700)."""
    d = Path(tempfile.mkdtemp(prefix="resilient-slurm-"))
    d.chmod(0o755)
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(host=host, dir=d, ctld_port=free_port(), d_port=free_port(), cpus=os.cpu_count() or 1))
    env = dict(os.environ, SLURM_CONF=str(conf))
    # Foreground daemons in sessions of their own: the fixture owns and ends them.
    cmds = [["munged", "-F", "-S", str(d / "munge.sock"), f"--key-file={key}", f"--pid-file={d}/munged.pid",
             f"--seed-file={d}/munged.seed", f"--log-file={d}/munged.log"],
            ["slurmctld", "-D", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf)]]
    procs = []
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
            if cmd[0] == "munged":
                _wait_for(lambda: (d / "munge.sock").exists(), "munged's socket")
        _wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                                   text=True).stdout, "the node to be idle", logs=d)
        yield env, d
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        shutil.rmtree(d, ignore_errors=True)


def _wait_for(cond, what: str, logs: Path | None = None, timeout: timedelta = timedelta(seconds=30)) -> None:
    import time

    deadline = time.monotonic() + timeout.total_seconds()
    while not cond():
        if time.monotonic() > deadline:
            tail = "".join(p.read_text()[-1500:] for p in (logs.glob("*.log") if logs else []))
            raise AssertionError(f"waited {timeout} for {what}\n{tail}")
        time.sleep(0.1)


def job_state(env: dict, job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) from scontrol (no accounting database here)."""
    text = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    return fields.get("JobState", "?"), fields.get("ExitCode", "?")


def test_sbatch_runs_two_agents_on_one_node(slurm, tmp_path, corpus):
    env, d = slurm
    work = tmp_path / "submit"
    work.mkdir()
    with embedded_etcd() as etcd:
        env = dict(env, RESILIENT_ETCD=etcd.endpoint, RESILIENT_AGENTS_PER_NODE="2",
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
        cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--chdir={work}", str(SBATCH),
               str(REPO / "configs" / "demo.toml"), "--set", "train.steps=3", "--set", "train.eval_every=0",
               "--set", "launch.nproc_per_node=1", "--set", "launch.spares=0",
               "--set", f"data.path={corpus}", "--set", 'data.source=""']
        sub = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, check=True)
        job_id = sub.stdout.strip().split(";")[0]
        # Polled here: `sbatch --wait` sleeps up to 32 s between its own polls.
        _wait_for(lambda: job_state(env, job_id)[0] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"),
                  f"job {job_id} to end", logs=d, timeout=JOB_TIMEOUT)
    state, code = job_state(env, job_id)
    log = work / f"slurm-{job_id}.out"
    text = log.read_text() if log.exists() else ""
    assert (state, code) == ("COMPLETED", "0:0"), f"{state} {code}\n{text[-4000:]}"
    run_dir = work / "runs" / f"slurm-{job_id}"
    evs = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    started = {e["node"] for e in evs if e["event"] == "agent_start"}
    host = socket.gethostname().split(".")[0]
    assert started == {host, f"{host}-1"}, started                   # node ids from Slurm's environment
    assert {e["node"] for e in evs if e["event"] == "step" and e["step"] == 3} == started  # trained together
    assert (run_dir / "job.secret").stat().st_mode & 0o077 == 0      # the job secret, private
