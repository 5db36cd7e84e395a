"""Another local user against a job's run dir (tests/attackutil.py), with real launches:

- a run dir planted in a shared place (0777, with the attacker's own 0600 job.secret) is refused
  with a typed error that gives the fix, and nothing of the attacker's is used; so is a secret
  file the attacker owns, and a run dir of ours the attacker could write;
- a real job run under umask 000 keeps its checkpoints, events, configs and secret from the
  attacker: every read and listing is refused by the modes;
- a node quarantined for a persistent bad device on one machine (embedded etcd, gone with the
  job) is refused at its relaunch, with a message naming `resilient quarantine clear`, until
  the operator clears it; the stop says the job cannot go on here (it was the only node).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launchutil import REPO, events, tiny_overrides
from resilient.rundir import RunDirUnsafe
from resilient.secret import RUN_DIR_SECRET, JobSecretError, provide_job_secret, resolve_secret

# three launches in one test: minutes each on a loaded 2-core host (generous bounds, not timing)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
DEMO = REPO / "configs" / "demo.toml"
FAULT = ('sdc.inject=[{target="grad", tensor="layers.1.attention.wq.weight", bit=30, node="solo", local_rank=1, '
         'step=3, persistent=true}]')


def launch(run_dir, overrides, *extra: str, umask: int | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "resilient.cli", "launch", "--run-dir", str(run_dir), "--node-id", "solo",
           "--nproc-per-node", "2", *extra]
    for o in overrides:
        cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_JOB_SECRET")}
    return subprocess.run([*cmd, str(DEMO)], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**env, "PYTHONUNBUFFERED": "1"},
                          preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)


def attacker_tries(attacker, paths) -> dict[str, str]:
    """path -> what the attacker got: 'refused', or what it read."""
    r = attacker.python("""
        import json, os, sys
        out = {}
        for p in sys.argv[1:]:
            try:
                out[p] = repr(os.listdir(p)) if os.path.isdir(p) else repr(open(p, "rb").read(64))
            except PermissionError:
                out[p] = "refused"
        print(json.dumps(out))
    """, *map(str, paths))
    assert r.returncode == 0, r.stderr
    import json

    return json.loads(r.stdout)


def test_a_planted_run_dir_and_secret_are_refused_nothing_of_theirs_used(attacker, public_tmp, corpus):
    os.chmod(public_tmp, 0o1777)   # a shared place, like /tmp
    run = public_tmp / "run"
    r = attacker.python("""
        import os, sys
        os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)
        fd = os.open(os.path.join(sys.argv[1], "job.secret"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"a" * 64 + b"\\n"); os.close(fd)
    """, str(run))
    assert r.returncode == 0, r.stderr
    planted = sorted(p.name for p in run.iterdir())
    got = launch(run, tiny_overrides(corpus, 2))
    assert got.returncode == 2, got.stderr[-2000:]
    assert f"run dir {run} is owned by {attacker.name}" in got.stderr and "Use a run dir of your own" in got.stderr
    assert sorted(p.name for p in run.iterdir()) == planted   # no event, no config, no etcd endpoint written
    assert (run / RUN_DIR_SECRET).read_text() == "a" * 64 + "\n" and attacker.owns(run / RUN_DIR_SECRET)


def test_a_secret_file_of_theirs_or_a_run_dir_they_can_write_is_refused(attacker, public_tmp, monkeypatch):
    for key in ("RESILIENT_JOB_SECRET", "RESILIENT_JOB_SECRET_FILE"):
        monkeypatch.delenv(key, raising=False)
    os.chmod(public_tmp, 0o1777)
    theirs = public_tmp / "their.secret"
    r = attacker.python("""
        import os, sys
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600); os.write(fd, b"b" * 64); os.close(fd)
    """, str(theirs))
    assert r.returncode == 0, r.stderr
    with pytest.raises(JobSecretError, match=f"owned by {attacker.name}.*Use a secret file of your own"):
        resolve_secret(theirs)
    # our own run dir, left writable by others: whatever they put in it is never adopted
    ours = public_tmp / "ours"
    ours.mkdir()
    os.chmod(ours, 0o777)
    r = attacker.python("""
        import os, sys
        fd = os.open(os.path.join(sys.argv[1], "job.secret"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"c" * 64); os.close(fd)
    """, str(ours))
    assert r.returncode == 0, r.stderr
    with pytest.raises(RunDirUnsafe, match="other users can write it|group or other users can write"):
        provide_job_secret(ours)


def test_a_job_under_umask_000_keeps_its_files_and_a_quarantine_outlives_its_etcd(attacker, public_tmp, corpus):
    """One node, the embedded etcd (it goes with the job), the widest umask. The node's second
    device corrupts every step from step 3: the node is quarantined and, being the only one, the
    job stops saying it cannot go on here. The attacker can read none of the job's files. A plain
    relaunch is refused until `resilient quarantine clear`; then the job trains to its end."""
    run = public_tmp / "run"
    over = tiny_overrides(corpus, 6, **{"snapshot.durable_every": 1, "snapshot.every": 1})
    first = launch(run, over + [FAULT], umask=0)
    assert first.returncode == 2, first.stderr[-3000:]
    assert "node 'solo' was quarantined" in first.stderr and "The job cannot go on here: no node is left" in first.stderr
    assert f"resilient quarantine clear solo --run-dir {run}" in first.stderr
    assert [e["node"] for e in events(run, "quarantine") if e["rank"] == -1] == ["solo"]

    # the job's files: under umask 000 the versions' own dirs are 0777, yet nothing is reachable
    everything = sorted(run.rglob("*"))
    assert any(p.name == "manifest.json" for p in everything) and (run / "events.jsonl") in everything
    got = attacker_tries(attacker, [run, *everything])
    assert {p: v for p, v in got.items() if v != "refused"} == {}
    assert os.stat(run).st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o077 == 0 for p in run.glob("*") if p.is_file())

    # the embedded etcd went with the job: the run dir's copy refuses the relaunch, before any worker
    starts = len(events(run, "workers_started"))
    again = launch(run, over)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "node 'solo' is quarantined since" in again.stderr
    assert f"`resilient quarantine clear solo --run-dir {run}`" in again.stderr
    assert len(events(run, "workers_started")) == starts

    cleared = subprocess.run([sys.executable, "-m", "resilient.cli", "quarantine", "clear", "solo", "--run-dir", str(run)],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert cleared.returncode == 0 and "cleared 'solo'" in cleared.stdout, cleared.stdout + cleared.stderr
    done = launch(run, over)
    assert done.returncode == 0, done.stderr[-3000:]
    assert max(e["step"] for e in events(run, "run_end")) == 6
