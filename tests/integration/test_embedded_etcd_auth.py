"""The embedded etcd of ``resilient launch`` lets only holders of the job secret in (issue 24, item 3).

Why it matters: the MACs of resilient.secret stop a forged record from being *believed*, but
not a record from being *deleted* (a quarantine record deleted admits a quarantined node) nor
junk from being written. The embedded etcd listens on loopback, where every local user can
reach it, so it runs with etcd's authentication: user root, with a password derived from the
job secret (``JobSecret.etcd_password``), never written anywhere; and (issue 39, item 3) with
client certificates from a CA derived from the secret (resilient.etcd.pki).

- unit: an EmbeddedEtcd with a root password refuses an anonymous put, delete and read and a
  wrong password (EtcdAuthError), takes the derived one, and stays so across a kill and
  restart and across an expired login token;
- the agent of another job secret is refused at the run dir's etcd with a clear error;
- ``resilient quarantine list|clear --run-dir`` finds and logs in to the run's embedded etcd;
- the attacker of the issue against a running job (one agent, two workers of
  examples/fsdp2_train.py): without the secret, knowing the endpoint, it can neither plant a
  pickle gadget in the rendezvous state, nor write a commit record for a newer step, nor
  delete the run's keys; the job (a worker killed afterwards: its restore reads etcd with
  the workers' login) ends exit 0, bitwise equal to a fault-free run, and no gadget ran.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from launchutil import REPO, Agent, digests, events, run_launch, steps_done, wait_for, worker_pids
from resilient.agent.quarantine import Quarantine, SlowMarks
from resilient.commands.quarantine import main as quarantine_cli
from resilient.errors import LaunchError
from resilient.etcd import EtcdAuthError, EtcdClient
from resilient.control.claim import peek_owner
from resilient.control.plane import client_kwargs
from resilient.etcd.server import EmbeddedEtcd, ROOT_USER, embedded_etcd_conf
from resilient.launch import default_run_id, etcd_endpoint
from resilient.secret import SECRET_ENV, SECRET_FILE_ENV, JobSecret, JobSecretError
from resilient.snapshot.commits import LOCAL
from resilient.snapshot.memcommit import commit_key
from resilient.snapshot.nodestore import reclaim

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

SECRET = JobSecret(b"a job secret of at least 32 bytes, for tests")
OTHER = JobSecret(b"another job's secret, also 32 bytes or more")
EXAMPLE = REPO / "examples" / "fsdp2_train.py"
STEPS = 30
SETS = ["snapshot.every=1"]


@pytest.fixture
def no_secret_env(monkeypatch):
    """Agents and CLIs of these tests find the secret in the run dir, as on one machine."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


@pytest.fixture
def secured():
    server = EmbeddedEtcd(root_password=SECRET.etcd_password, extra_args=["--auth-token-ttl=1"])
    with server:
        yield server


def refusals(client: EtcdClient) -> dict[str, str]:
    """What an anonymous (or wrongly logged-in) client gets for a write, a delete and a read."""
    out = {}
    for what, call in (("put", lambda: client.put("/resilient/x/k", "junk")),
                       ("delete", lambda: client.delete_prefix("/resilient/")),
                       ("get", lambda: client.get_prefix("/resilient/"))):
        try:
            call()
            out[what] = "accepted"
        except EtcdAuthError as e:
            out[what] = str(e)
    return out


def test_anonymous_and_wrong_logins_are_refused_the_derived_one_works_across_restarts(secured):
    quick = dict(retry_timeout=timedelta(seconds=2))
    with secured.client(**quick) as root:  # logged in as root with the derived password
        root.put("/resilient/x/k", "v")
        with secured.client(username=None, password=None, **quick) as anonymous:
            got = refusals(anonymous)
        assert all("user name is empty" in why for why in got.values()), got
        with secured.client(password=OTHER.etcd_password, **quick) as wrong:
            got = refusals(wrong)
        assert all("refused user 'root'" in why for why in got.values()), got
        assert root.get("/resilient/x/k").value == b"v"

        time.sleep(2.5)  # the login token (--auth-token-ttl=1) has expired: the client logs in again
        assert root.get("/resilient/x/k").value == b"v"
        secured.kill()   # a crash; the restart keeps the data dir, so the users and auth
        secured.start()
        assert root.get("/resilient/x/k").value == b"v"  # the old token is gone with the process
        with secured.client(username=None, password=None, **quick) as anonymous:
            assert refusals(anonymous)["delete"].startswith("etcd delete prefix")
        assert root.get("/resilient/x/k").value == b"v"
        users = root._post("/auth/user/list", {}, "list users")["users"]
    assert users == [ROOT_USER]


def test_an_agent_with_another_secret_is_refused_at_the_run_dirs_etcd(tmp_path):
    """The owner's record (RUN_DIR/control/etcd.json) is sealed with its secret: an agent of
    another secret is refused before it connects (ClaimForged, a LaunchError); the same secret joins."""
    args = argparse.Namespace(rdzv_endpoint=None, standalone=False)
    with etcd_endpoint(args, tmp_path, secret=SECRET) as owned:   # this process owns the run dir's etcd
        with pytest.raises(LaunchError, match="another secret") as info:
            with etcd_endpoint(args, tmp_path, secret=OTHER):
                pass
        assert OTHER.fingerprint in str(info.value) and OTHER.etcd_password not in str(info.value)
        with etcd_endpoint(args, tmp_path, secret=SECRET) as endpoint:  # the run's own secret joins it
            assert endpoint == owned


def test_quarantine_cli_logs_in_to_the_runs_embedded_etcd(tmp_path, capsys, no_secret_env):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "job.secret").write_bytes(SECRET.material)
    (run_dir / "job.secret").chmod(0o600)
    run_id = default_run_id(run_dir)
    args = argparse.Namespace(rdzv_endpoint=None, standalone=False)
    with etcd_endpoint(args, run_dir, secret=SECRET) as endpoint, \
            EtcdClient(endpoint, **client_kwargs(embedded_etcd_conf(SECRET))) as root:
        secured = argparse.Namespace(endpoint=endpoint)
        q = Quarantine(root, run_id, SECRET)
        q.add("bad", reason="sdc")
        marks = SlowMarks(root, run_id, SECRET)
        marks.add("slowpoke", cause="device", factor=1.8)
        with pytest.raises(JobSecretError):  # no secret: the login cannot be made
            quarantine_cli(["clear", "bad", "--rdzv-endpoint", secured.endpoint, "--run-id", run_id])
        assert q.get("bad") is not None
        assert quarantine_cli(["list", "--run-dir", str(run_dir)]) == 0
        listed = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
        assert [(r["kind"], r["node"]) for r in listed] == [("quarantine", "bad"), ("slow", "slowpoke")]
        assert listed[1]["factor"] == 1.8
        assert quarantine_cli(["clear", "bad", "--run-dir", str(run_dir)]) == 0
        assert q.get("bad") is None and marks.get("slowpoke") is not None
        assert quarantine_cli(["clear", "slowpoke", "--run-dir", str(run_dir)]) == 0
        assert marks.get("slowpoke") is None
        assert quarantine_cli(["clear", "slowpoke", "--run-dir", str(run_dir)]) == 1


# The attacker: a process of another user of the host, in effect: our client (so its errors are
# typed), the endpoint from the run dir, the run id derived from the run dir's path (both are
# public), no job secret. It prints what each attempt got.
ATTACKER = r"""
import json, os, pickle, sys
from datetime import timedelta
from resilient.etcd import EtcdError, EtcdClient

endpoint, run_id, commit_key, gadget_path = sys.argv[1:]

class Gadget:
    def __reduce__(self):
        return os.system, (f"touch {gadget_path}",)

forged = json.dumps({"step": 10**6, "attempt": 0, "tier": "local", "holders": {"0": ["a"]}, "mac": "0" * 64})
attempts = {
    "rendezvous state gadget": lambda c: c.put(f"/resilient/rdzv/{run_id}/state", pickle.dumps(Gadget())),
    "newer commit record": lambda c: c.put(commit_key, forged),
    "delete the run's keys": lambda c: c.delete_prefix(f"/resilient/{run_id}/"),
    "delete the rendezvous": lambda c: c.delete_prefix(f"/resilient/rdzv/{run_id}/"),
    "read the run's keys": lambda c: c.get_prefix(f"/resilient/{run_id}/"),
}
out = {}
with EtcdClient(endpoint, retry_timeout=timedelta(seconds=1)) as c:
    for name, attempt in attempts.items():
        try:
            attempt(c)
            out[name] = "accepted"
        except EtcdError as e:
            out[name] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def committed(run) -> int:
    return max((e["step"] for e in events(run, "commit")), default=0)


def test_an_attacker_without_the_secret_cannot_touch_a_running_jobs_etcd(tmp_path, no_secret_env):
    ref = tmp_path / "ref"
    run_launch(EXAMPLE, ref, SETS, nproc=2, script_args=["--steps", str(STEPS)])
    run = tmp_path / "run"
    run.mkdir()
    gadget = tmp_path / "gadget-ran"
    # Paced so that the job outlasts the attacker's process (5 refused requests, its imports): at
    # 0.15 s a step, with the suite beside two busy loops, the job had ended before the kill.
    agent = Agent(EXAMPLE, run, SETS, "a", nproc=2, script_args=["--steps", str(STEPS), "--pace", "0.5"])
    try:
        wait_for(lambda: committed(run) >= 3, 90, "the first memory-tier commits")
        assert (run / "job.secret").stat().st_mode & 0o077 == 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_")}
        attacker = subprocess.run(
            [sys.executable, "-c", ATTACKER, peek_owner(run).endpoint, default_run_id(run),
             commit_key(default_run_id(run), LOCAL, 10**6), str(gadget)], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True,
            timeout=60)
        assert attacker.returncode == 0, attacker.stderr[-3000:]
        got = json.loads(attacker.stdout)
        # After the attack a worker dies: its restore reads the commit records and the node
        # registry from etcd, logged in with the credentials its agent gave it.
        assert agent.alive() and steps_done(run) < STEPS, "the job ended before the attack did"
        os.kill(worker_pids(run, "a")[0], signal.SIGKILL)
        assert agent.wait(90) == 0, agent.output()[-3000:]
    finally:
        agent.close()
        reclaim("/dev/shm", default_run_id(run))
    assert set(got) == {"rendezvous state gadget", "newer commit record", "delete the run's keys",
                        "delete the rendezvous", "read the run's keys"}
    # Refused before any request is read: plain HTTP to its TLS-only port is dropped (tests/
    # test_attack_etcd.py tries TLS without the job's client certificate, and with its own).
    refused = {name: why.startswith("Etcd") and why != "accepted" for name, why in got.items()}
    assert all(refused.values()), got
    assert not gadget.exists(), "the pickled gadget ran"
    restored = [(e["tier"], e["step"]) for e in events(run, "restore") if e["step"] > 0]
    assert restored and all(t == "local" for t, _ in restored), restored
    assert not events(run, "auth_failure"), "a record the attacker wrote was read back"
    assert digests(run) == digests(ref) and len(digests(ref)) == 2, "final state differs from the fault-free run"
