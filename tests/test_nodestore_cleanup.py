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
