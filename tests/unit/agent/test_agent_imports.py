"""What the agent's process imports: the node store's side of the snapshot path (replication,
commit, restore planning) reads boxes and manifests, never a DTensor, so the agent does not
import torch's DTensor package (~1.2 s of CPU at every agent's start, measured with
``python -X importtime``; every node, every relaunch, every test that launches a job)."""

from __future__ import annotations

import json
import subprocess
import sys

AGENT_SIDE = ("resilient.launch", "resilient.agent.agent", "resilient.agent.store", "resilient.snapshot.memcommit",
              "resilient.snapshot.peer", "resilient.snapshot.tiers", "resilient.gpt.program")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "torch.distributed.tensor" or m.startswith("torch.distributed.tensor."))))
"""


def test_the_agents_modules_do_not_import_the_dtensor_package():
    out = subprocess.run([sys.executable, "-c", PROBE, *AGENT_SIDE], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_box_arithmetic_still_reads_dtensor_placements_where_it_is_asked_to():
    from torch.distributed.tensor import Replicate, Shard

    from resilient.snapshot.boxes import Box, is_primary_replica, shard_pieces

    (piece,) = shard_pieces((10, 4), (3,), (1,), [Shard(0)])   # torch.chunk sizes: 4, 4, 2
    assert piece.box == Box((4, 0), (4, 4)) and piece.local == Box((0, 0), (4, 4))
    assert is_primary_replica((0, 1), [Replicate(), Shard(0)]) and not is_primary_replica((1, 0), [Replicate(), Shard(0)])
