"""No node store outlives its job: a store whose owner was killed with SIGKILL is
reclaimed by the next start of the same job; a live owner's store is left alone."""

from __future__ import annotations

import subprocess
import sys

from resilient.snapshot.nodestore import NodeStore, job_dir, reclaim

OWNER = """
import sys, time
from resilient.snapshot.nodestore import NodeStore
s = NodeStore(sys.argv[1], "job", sys.argv[2]); s.create()
w = s.writer("step-000000000001/abc-000000/r00000.json"); w.write(b"{}"); w.commit(2, __import__("resilient.snapshot.format", fromlist=["crc"]).crc(b"{}"))
print("ready", flush=True); time.sleep(120)
"""


def _owner(base, node):
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(base), node], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_killed_owner_is_reclaimed_live_owner_kept(tmp_path):
    dead, live = _owner(tmp_path, "dead"), _owner(tmp_path, "live")
    try:
        dead.kill()
        dead.wait(10)
        assert sorted(p.name for p in job_dir(tmp_path, "job").iterdir()) == ["dead", "live"]
        me = NodeStore(tmp_path, "job", "me")
        assert me.create() == ["dead"]
        assert sorted(p.name for p in job_dir(tmp_path, "job").iterdir()) == ["live", "me"]
        me.remove()
    finally:
        live.kill()
        live.wait(10)
    assert reclaim(tmp_path, "job") == ["live"]
    assert not job_dir(tmp_path, "job").exists()


def test_dead_trees_of_other_jobs_are_reclaimed_foreign_dirs_kept(tmp_path):
    dead = _owner(tmp_path, "x")  # a job ("job") that will never start again here
    dead.kill()
    dead.wait(10)
    foreign = tmp_path / "resilient-something" / "data"
    foreign.mkdir(parents=True)  # no owner.json: not a node store, not ours to delete
    NodeStore(tmp_path, "another-job", "n0").create()
    assert not job_dir(tmp_path, "job").exists()
    assert foreign.exists()


def test_agent_dirs_of_dead_owners_are_reclaimed(tmp_path):
    """An agent killed with -9 leaves its heartbeat dir; the next agent removes it
    (owner dead, or no owner file for over an hour), and nothing else."""
    import json
    import os
    import subprocess
    import sys
    import time

    from resilient.procs import OWNER, owner_record, reclaim_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, owner in (("resilient-agent-a-dead", {"pid": dead.pid, "pid_started": 1.0}),
                        ("resilient-agent-b-live", None), ("resilient-agent-c-old", False),
                        ("resilient-agent-d-new", False), ("someone-else", {"pid": dead.pid, "pid_started": 1.0})):
        d = tmp_path / name
        d.mkdir()
        if owner is None:
            (d / OWNER).write_text(owner_record())
        elif owner:
            (d / OWNER).write_text(json.dumps(owner))
    old = time.time() - 7200
    os.utime(tmp_path / "resilient-agent-c-old", (old, old))
    removed = sorted(os.path.basename(p) for p in reclaim_dirs(tmp_path, "resilient-agent-"))
    assert removed == ["resilient-agent-a-dead", "resilient-agent-c-old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resilient-agent-b-live", "resilient-agent-d-new",
                                                          "someone-else"]


def test_a_live_owner_stays_alive_when_the_wall_clock_moved_since_it_started(tmp_path):
    """psutil's create_time is the boot time (the wall clock minus the uptime, whole seconds)
    plus the start ticks: after the wall clock drifted or was stepped past a second's edge, a
    live owner's recorded start was 1 s off, and a replacement agent reclaimed live agents'
    trees (the soak). The start ticks since boot decide; a pid reused by another process
    (other ticks) is still dead."""
    import json

    from resilient.procs import OWNER, owner_alive, owner_record, reclaim_dirs

    me = json.loads(owner_record())
    live, reused = tmp_path / "resilient-agent-live", tmp_path / "resilient-agent-reused"
    live.mkdir()
    reused.mkdir()
    (live / OWNER).write_text(json.dumps({**me, "pid_started": me["pid_started"] - 1.0}))
    (reused / OWNER).write_text(json.dumps({**me, "pid_ticks": me["pid_ticks"] - 1}))
    assert owner_alive(live) and not owner_alive(reused)
    assert [p.rsplit("/", 1)[-1] for p in reclaim_dirs(tmp_path, "resilient-agent-")] == ["resilient-agent-reused"]


def test_a_job_root_removed_by_another_agents_reclaim_while_creating_is_made_again(tmp_path, monkeypatch):
    """Two agents of one job starting at once on one machine: the other one's reclaim
    removes the job's root while it is still empty, between our mkdir of the root and of
    our hidden tree (CI's 32-node simulator hit this window)."""
    import os

    root, real_mkdir, removed = str(job_dir(tmp_path, "job")), os.mkdir, []

    def mkdir_then_lose_the_root(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if os.fspath(path) == root and not removed:
            removed.append(os.rmdir(root))  # the other agent's `root.rmdir()`

    monkeypatch.setattr(os, "mkdir", mkdir_then_lose_the_root)
    s = NodeStore(tmp_path, "job", "n0")
    s.create()
    assert removed and (job_dir(tmp_path, "job") / "n0").is_dir()
    s.remove()
