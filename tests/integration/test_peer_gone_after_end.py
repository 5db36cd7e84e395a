"""A worker stopping after its clean run_end logs no error (issue 38, item 4): two workers of a
user's script end their run (run_end, state saved); one leaves at once, the other then calls a
collective that gloo fails because its peer is gone. That is said in one line, not as a
`worker_error` with a traceback, and the job exits 0. An error of the script's own after the end
is still a worker_error."""

from __future__ import annotations

import textwrap

import pytest

from launchutil import events, run_launch

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import resilient

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = resilient.Job(model=model, optimizer=opt)
    for step in job.steps(3):
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step(); opt.zero_grad()
    job.close()
    if dist.get_rank() == 1:
        sys.exit(0)                       # this peer leaves at once
    if os.environ.get("AFTER_END") == "bug":
        raise ValueError("the script's own bug after the end")
    dist.all_reduce(torch.ones(1))        # gloo: the peer is gone
""")
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]


def test_a_peer_gone_after_a_clean_run_end_is_not_a_worker_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    proc = run_launch(script, run, ["launch.max_restarts=0"], nproc=2, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(events(run, "run_end")) == 2
    assert not events(run, "worker_error"), events(run, "worker_error")
    assert "after that a collective failed because a peer had already left" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_scripts_own_error_after_the_end_is_still_a_worker_error(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    monkeypatch.setenv("AFTER_END", "bug")
    proc = run_launch(script, run, ["launch.max_restarts=0"], nproc=2, check=False)
    assert proc.returncode != 0
    errors = events(run, "worker_error")
    assert [e["error"] for e in errors] == ["ValueError: the script's own bug after the end"], errors
