"""Node stores left by dead agents: kept while their run is unfinished and adopted by a
relaunch of the same run and node (issue 38); removed when the run finishes, when another
run's is a day idle or the tmpfs runs short, or by ``resilient store drop``; a live
owner's store is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from resilient.commands.store import main as store_command
from resilient.snapshot import storeroot
from resilient.snapshot.nodestore import NodeStore, job_dir
from resilient.snapshot.storeroot import drop_dead, node_trees, reclaim_run

OWNER = """
import sys, time
from resilient.snapshot.nodestore import NodeStore
s = NodeStore(sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else "job", sys.argv[2]); s.create()
w = s.writer("step-000000000001/abc-000000/r00000.json"); w.write(b"{}"); w.commit(2, __import__("resilient.snapshot.format", fromlist=["crc"]).crc(b"{}"))
print("ready", flush=True); time.sleep(120)
"""


def _owner(base, node, run="job"):
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(base), node, run], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _kill(p) -> None:
    p.kill()
    p.wait(10)


def test_a_dead_agents_tree_is_kept_and_adopted_by_its_relaunch(tmp_path):
    dead, live = _owner(tmp_path, "dead"), _owner(tmp_path, "live")
    try:
        _kill(dead)
        other = NodeStore(tmp_path, "job", "me")  # another node of the unfinished run starts here
        assert other.create() == [] and other.adopted == []
        assert sorted(p.name for p in job_dir(tmp_path, "job").iterdir()) == ["dead", "live", "me"]
        again = NodeStore(tmp_path, "job", "dead")  # the relaunch of the dead node
        again.create()
        assert [(v.step, v.attempt, sorted(v.ranks)) for v in again.adopted] == [(1, "abc-000000", [0])]
        assert {t.node: t.alive for t in node_trees(tmp_path)} == {"dead": True, "live": True, "me": True}
        again.keep("SIGTERM")  # stopped with the run unfinished: kept, marked
        assert (again.path / storeroot.KEPT).exists() and again.path.is_dir()
        # the run finishes on "me": it removes its own and the dead trees of the run, not a live one's
        assert reclaim_run(tmp_path, "job", but="me") == []  # "dead"'s owner is this process: alive
        other.remove()
    finally:
        _kill(live)
    assert sorted(reclaim_run(tmp_path, "job")) == ["live"]  # ("dead": adopted by this live process)


def test_other_runs_dead_trees_go_after_a_day_or_when_space_is_short(tmp_path, monkeypatch):
    for run in ("old", "fresh"):
        _kill(_owner(tmp_path, "x", run))
    foreign = storeroot.user_root(tmp_path) / "resilient-something" / "data"
    foreign.mkdir(parents=True)  # no owner.json: not a node store, not ours to delete
    day_ago = time.time() - storeroot.KEEP_DEAD.total_seconds() - 60
    for e in os.scandir(job_dir(tmp_path, "old") / "x"):
        os.utime(e.path, (day_ago, day_ago), follow_symlinks=False)
    assert NodeStore(tmp_path, "another-job", "n0").create() == ["old/x"]
    assert (job_dir(tmp_path, "fresh") / "x").is_dir() and not job_dir(tmp_path, "old").exists()
    monkeypatch.setattr(storeroot, "_short_of_space", lambda base: True)  # a later job needs the space
    assert NodeStore(tmp_path, "third-job", "n0").create() == ["fresh/x"]
    assert foreign.exists()
    assert drop_dead(tmp_path) == []  # the two stores made here are this live process's


def test_store_drop_removes_dead_trees_only(tmp_path, capsys):
    _kill(_owner(tmp_path, "gone", "r1"))
    live = NodeStore(tmp_path, "r2", "n0")
    live.create()
    assert store_command(["--store-dir", str(tmp_path), "ls"]) == 0
    listing = capsys.readouterr().out
    assert "r1" in listing and "dead" in listing and "live" in listing
    assert store_command(["--store-dir", str(tmp_path), "drop"]) == 0
    assert "dropped r1/gone" in capsys.readouterr().out
    assert [t.run_id for t in node_trees(tmp_path)] == ["r2"]
    live.remove()


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
