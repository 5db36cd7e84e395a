"""Every node lost, its RAM too: the next start restores from durable storage. The newest
durable version was forged as an attacker with write access to the storage would (a chunk
of 1e4 with its CRC-32C recomputed in the manifest): it is refused (``auth_failure``) and
the one before it restored, and the run ends bitwise equal to its fault-free twin; its
clean exit leaves nothing in /dev/shm."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from launchutil import REPO, Agent, digests, events, run_launch, steps_done, tiny_overrides, wait_for
from resilient_chaos.etcd_testing import embedded_etcd
from resilient.launch import default_run_id
from resilient.snapshot.format import checksum
from resilient.snapshot.nodestore import job_dir

DEMO = REPO / "configs" / "demo.toml"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # minutes on a loaded 2-core host


def forge_newest_durable(ckpt) -> int:
    vdir = sorted(ckpt.glob("step-*/manifest.json"))[-1].parent
    manifest = vdir / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    c = next(c for t in doc["tensors"].values() for c in t["chunks"] if c["length"] >= 64)
    poison = torch.full((c["length"] // 4,), 1e4).numpy().tobytes()
    part = vdir / c["object"]
    data = bytearray(part.read_bytes())
    data[c["offset"]:c["offset"] + c["length"]] = poison
    part.write_bytes(bytes(data))
    manifest.write_text(manifest.read_text().replace(c["checksum"], checksum(poison)))
    return doc["step"]


def test_all_nodes_lost_restore_from_durable_refusing_a_forged_version(corpus, tmp_path):
    over = tiny_overrides(corpus, 24, **{"snapshot.every": 1, "snapshot.durable_every": 4})
    ref = tmp_path / "ref"
    run_launch(DEMO, ref, over, nproc=2)
    run = tmp_path / "run"
    run.mkdir()
    shm = job_dir("/dev/shm", default_run_id(run))
    with embedded_etcd() as etcd:
        first = Agent(DEMO, run, over, "n0", endpoint=etcd.endpoint, nproc=2)
        try:
            wait_for(lambda: len([e for e in events(run, "commit") if e["tier"] == "durable"]) >= 2, 300,
                     "two durable commits")
            wait_for(lambda: steps_done(run) >= 10, 300, "more steps")
        finally:
            first.close()  # kill -9 of agent and workers: nothing cleans up
        assert sorted(p.name for p in shm.iterdir()) == ["n0"], "the killed node's store is still there"
        shutil.rmtree(shm / "n0")  # the machine is lost: its RAM with it
        forged = forge_newest_durable(run / "checkpoints")
        second = Agent(DEMO, run, over, "n0", endpoint=etcd.endpoint, nproc=2)
        try:
            assert second.wait(300) == 0, second.output()[-3000:]
        finally:
            second.close()
    restores = [e for e in events(run, "restore") if e["step"] > 0]
    assert restores and {e["tier"] for e in restores} == {"durable"}
    assert 0 < restores[0]["step"] < forged, restores
    assert any(e["event"] == "auth_failure" and f"{forged:012d}" in e["key"] for e in events(run))
    assert max(e["step"] for e in events(run, "step")) == 24
    assert digests(run) == digests(ref) and len(digests(ref)) == 2
    assert not shm.exists(), "a clean exit leaves no node store"
