"""Attacks on a real job's snapshots (issue 39 items 1-2, issue 38 item 3), real processes:

* another local user can neither list nor read the node store of a running job;
* a dead agent's node store is kept and its relaunch on the same machine restores from it;
  a version in it forged as it was done before (a chunk of 1e4, its CRC-32C recomputed in
  the rank manifest) is refused (``auth_failure``) and an older kept version used instead:
  the job ends bitwise equal to its fault-free twin, nothing of the forgery loaded;
* a node-store root another user planted stops the launch with a typed error naming the fix,
  and nothing of the job is written into it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from launchutil import REPO, Agent, digests, events, run_launch, steps_done, tiny_overrides, wait_for
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.launch import default_run_id
from resilient.snapshot.format import checksum
from resilient.snapshot.nodestore import NodeStore, job_dir, reclaim

DEMO = REPO / "configs" / "demo.toml"
STEPS = 16
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # minutes on a loaded 2-core host


def overrides(corpus):
    # durable only at the end: a restore mid-run can only come from RAM
    return tiny_overrides(corpus, STEPS, **{"snapshot.every": 1, "snapshot.durable_every": 0,
                                            "launch.heartbeat_timeout": 60.0})


def forge_newest(store: NodeStore) -> int:
    """The attack of issue 39 on the newest whole version in ``store``: rank 0's first chunk set
    to 1e4 everywhere and its CRC-32C recomputed in the rank manifest. Returns its step."""
    v = max((v for v in store.versions() if v.ranks == {0, 1}), key=lambda v: v.step)
    rel = f"step-{v.step:012d}/{v.attempt}/r00000.json"
    doc = json.loads(store.read(rel))
    c = next(c for t in doc["tensors"].values() for c in t["chunks"] if c["length"] >= 64)
    poison = torch.full((c["length"] // 4,), 1e4).numpy().tobytes()
    part = store.file(f"step-{v.step:012d}/{c['object']}")
    data = bytearray(part.read_bytes())
    data[c["offset"]:c["offset"] + c["length"]] = poison
    part.write_bytes(bytes(data))
    text = store.read(rel).decode().replace(c["checksum"], checksum(poison))
    store.file(rel).write_text(text)
    return v.step


def test_a_kept_store_is_private_adopted_and_a_forged_version_in_it_refused(corpus, tmp_path, attacker):
    ref = tmp_path / "ref"
    run_launch(DEMO, ref, overrides(corpus), nproc=2)
    run = tmp_path / "run"
    run.mkdir()
    tree = job_dir("/dev/shm", default_run_id(run)) / "n0"
    with embedded_etcd() as etcd:
        first = Agent(DEMO, run, overrides(corpus), "n0", endpoint=etcd.endpoint, nproc=2)
        second = None
        try:
            # Early (a margin of many steps), then frozen: however long the attacker's peek takes
            # on a loaded host, the job cannot finish, and remove its store, before the kill.
            wait_for(lambda: steps_done(run) >= 4 and [e for e in events(run, "commit") if e["tier"] == "local"],
                     600, "the first steps and a local commit")
            os.killpg(first.proc.pid, signal.SIGSTOP)   # (kill_node's SIGKILL ends stopped processes too)
            peek = attacker.python("""
                import os, sys
                for p in sys.argv[1:]:
                    try:
                        print(p, os.listdir(p) if os.path.isdir(p) else open(p, "rb").read(8))
                    except OSError as e:
                        print(p, type(e).__name__)
            """, str(tree.parent.parent), str(tree), str(tree / "owner.json"))
            assert peek.stdout.count("PermissionError") == 3, peek.stdout + peek.stderr
            first.kill_node()  # kill -9 of agent and workers: the run is unfinished
            store = NodeStore("/dev/shm", default_run_id(run), "n0")
            assert tree.is_dir() and len(store.versions()) >= 2, "the dead agent's store is kept"
            forged = forge_newest(store)
            second = Agent(DEMO, run, overrides(corpus), "n0", endpoint=etcd.endpoint, nproc=2)
            assert second.wait(600) == 0, second.output()[-3000:]
            assert not tree.exists(), "the finished run removes its store"
        finally:
            for agent in (first, second):
                if agent is not None:
                    agent.close()
            reclaim("/dev/shm", default_run_id(run))
    adopted = events(run, "store_adopted")
    assert adopted and forged in adopted[0]["steps"]
    restores = [e for e in events(run, "restore") if e["step"] > 0]
    assert restores and restores[0]["tier"] == "local" and 0 < restores[0]["step"] < forged, restores
    fails = events(run, "auth_failure")
    assert fails and any(f"{forged:012d}" in e["key"] for e in fails), fails
    assert digests(run) == digests(ref) and len(digests(ref)) == 2


def test_a_planted_store_root_stops_the_launch_and_is_never_used(corpus, tmp_path, attacker, public_tmp):
    os.chmod(public_tmp, 0o755)
    shm = public_tmp / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)  # like /dev/shm: every user may create names in it
    planted = shm / f"resilient-u{os.geteuid()}"
    got = attacker.python("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", str(planted))
    assert got.returncode == 0, got.stderr
    run = tmp_path / "run"
    proc = run_launch(DEMO, run, overrides(corpus) + [f"snapshot.store_dir={json.dumps(str(shm))}"], nproc=1,
                      check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "StoreNotPrivate" in proc.stderr or "belongs to uid" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert os.listdir(planted) == [], "the job wrote into a directory another user controls"
