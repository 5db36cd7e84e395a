"""The run dir's control-plane claim (resilient.control.claim), with real processes and real kills.

Issue 38 item 1: two agents on one run dir, started together or over a stale claim a kill -9
left, each started an etcd and waited for the other in silence. Here: N processes race for
the claim of one run dir, from an empty one and from one whose owner was killed with -9
(its record still names it): exactly one owns it, every other one ends on the owner's
endpoint. A record sealed with another secret that names a live process is refused; one
that names a dead process is stale, whoever wrote it. An owner that never publishes ends
the others' wait at its bound, with a typed error naming it.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from launchutil import REPO
from resilient.control.api import ClaimForged, ClaimSettings, ClaimTimeout, OwnerRecord
from resilient.control.claim import RECORD_KEY, PURPOSE, RunDirClaim, lock_holders, read_owner
from resilient.secret import JobSecret

SECRET = JobSecret(b"the claim tests' job secret, 32 bytes or more")
OTHER = JobSecret(b"another job's secret, of 32 bytes or more too")

# One contender: waits for the start file (all start at once), joins, and if it owns the claim
# publishes a made-up endpoint naming its pid, then holds it until told to stop (or killed).
CONTENDER = r"""
import os, sys, time, json
from datetime import timedelta
from resilient.control.api import ClaimSettings
from resilient.control.claim import RunDirClaim
from resilient.secret import JobSecret

run_dir, go, stop = sys.argv[1:4]
while not os.path.exists(go):
    time.sleep(0.001)
claim = RunDirClaim(run_dir, JobSecret(os.environb[b"SECRET"]), ClaimSettings(wait=timedelta(seconds=60)),
                    say=lambda line: None)
owner = claim.join()
if owner is None:
    claim.publish(f"127.0.0.1:{os.getpid()}")
    print(json.dumps({"pid": os.getpid(), "owner": True}), flush=True)
    while not os.path.exists(stop):
        time.sleep(0.01)
    claim.release()
else:
    print(json.dumps({"pid": os.getpid(), "owner": False, "endpoint": owner.endpoint}), flush=True)
"""


def contenders(run_dir, n, tmp_path, secret=SECRET):
    go, stop = tmp_path / "go", tmp_path / "stop"
    go.unlink(missing_ok=True)
    stop.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(run_dir), str(go), str(stop)], cwd=REPO,
                              env=dict(os.environ, SECRET=secret.material.decode()), stdout=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(n)]
    return procs, go, stop


def finish(procs, stop, timeout=60):
    """Each contender's answer; the owner's is read first, then it is told to stop."""
    answers = []
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line, f"contender {p.pid} said nothing (exit {p.poll()})"
            answers.append(json.loads(line))
        stop.touch()
        for p in procs:
            assert p.wait(timeout) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return answers


def one_owner_everyone_on_its_endpoint(answers):
    owners = [a for a in answers if a["owner"]]
    assert len(owners) == 1, answers
    endpoints = {a["endpoint"] for a in answers if not a["owner"]}
    assert endpoints == {f"127.0.0.1:{owners[0]['pid']}"}, answers
    return owners[0]["pid"]


def test_processes_started_at_once_agree_on_one_owner(tmp_path):
    run_dir = tmp_path / "run"
    procs, go, stop = contenders(run_dir, 6, tmp_path)
    time.sleep(1.0)   # all polling for the start file
    go.touch()
    one_owner_everyone_on_its_endpoint(finish(procs, stop))
    control = run_dir / "control"
    assert stat.S_IMODE(control.stat().st_mode) == 0o700
    assert not (control / "etcd.json").exists(), "the owner's release left its record"


def test_a_stale_claim_of_a_killed_owner_is_taken_over_by_exactly_one(tmp_path):
    run_dir = tmp_path / "run"
    (first,), go, stop = contenders(run_dir, 1, tmp_path)
    go.touch()
    try:
        assert json.loads(first.stdout.readline())["owner"] is True
        record = (run_dir / "control" / "etcd.json").read_text()
        assert json.loads(record)["pid"] == first.pid
        assert stat.S_IMODE((run_dir / "control" / "etcd.json").stat().st_mode) == 0o600
    finally:
        os.killpg(first.pid, signal.SIGKILL)   # no cleanup runs: the record stays, the kernel drops the lock
        first.wait()
    assert (run_dir / "control" / "etcd.json").read_text() == record
    assert read_owner(run_dir, SECRET) is None, "a dead owner's record was taken for a live one"
    procs, go, stop = contenders(run_dir, 5, tmp_path)
    time.sleep(1.0)
    go.touch()
    new_owner = one_owner_everyone_on_its_endpoint(finish(procs, stop))
    assert new_owner != first.pid


def test_a_record_of_another_secret_naming_a_live_process_is_refused(tmp_path):
    """A live lock holder whose record does not authenticate: its agent has another secret (or
    the record is forged). Joining it would split the job: refused, typed. The same record
    naming a dead process is stale: ignored (the lock decides)."""
    run_dir = tmp_path / "run"
    holder = RunDirClaim(run_dir, OTHER)
    assert holder.join() is None
    holder.publish("127.0.0.1:2379")   # sealed with OTHER, naming this (live) process
    try:
        with pytest.raises(ClaimForged, match="another secret") as info:
            RunDirClaim(run_dir, SECRET).join()
        assert OTHER.fingerprint not in str(info.value) and SECRET.fingerprint in str(info.value)
        # A forged record (no valid MAC at all) naming a live process: refused the same way.
        doc = OwnerRecord("127.0.0.1:1", os.getpid(), None, "h").doc()
        (run_dir / "control" / "etcd.json").write_text(json.dumps({**doc, "mac": "00" * 32}))
        with pytest.raises(ClaimForged):
            read_owner(run_dir, SECRET)
        # Naming a dead process: stale, not an error (the next owner overwrites it).
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
        stale = OTHER.seal_record(PURPOSE, RECORD_KEY, OwnerRecord("127.0.0.1:1", int(gone), None, "h").doc())
        (run_dir / "control" / "etcd.json").write_text(stale)
        assert read_owner(run_dir, SECRET) is None
    finally:
        holder.release()
    mine = RunDirClaim(run_dir, SECRET)
    assert mine.join() is None, "the lock is free: the stale record must not stop a new owner"
    mine.release()


def test_an_owner_that_never_publishes_ends_the_wait_at_its_bound_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    said: list[str] = []
    settings = ClaimSettings(wait=timedelta(seconds=1.5), progress_every=timedelta(seconds=0.5),
                             poll=timedelta(seconds=0.05))
    waiting = RunDirClaim(run_dir, SECRET, settings, say=said.append)   # makes the control dir (0700)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(120)",
                               str(waiting.lock_path)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_holders(waiting.lock_path) == [holder.pid]
        with pytest.raises(ClaimTimeout, match=str(holder.pid)):
            waiting.join()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    assert said and all("has not published its endpoint yet" in s and str(holder.pid) in s for s in said), said
