"""The embedded control plane of ``resilient launch``: one etcd per run dir, owned by one agent.

Without ``--rdzv-endpoint``, the agents of a run dir share an etcd that one of them runs:
the one whose claim on the run dir succeeds (:mod:`resilient.control.claim`: atomic, crash
safe, every agent ends on the same endpoint whatever its timing). The owner's etcd is:

- private: it requires a client certificate signed by a CA derived from the job secret
  (:mod:`resilient.etcd.pki`), on its client and its peer port, and a login as ``root`` with
  a password derived from the secret. A local user without the secret is refused in the TLS
  handshake: none of its requests (the NOSPACE alarm of etcd 3.4/3.5's auth gap, an
  anonymous lease grant or keep-alive) is read. The files are derived on each node from
  the secret into ``RUN_DIR/control/tls-<fingerprint>`` (0700, files 0600): nothing to distribute.
- watched: restarted on the same ports and data when it dies, so the clients ride through.
- kept up, at the end, for what the caller's ``before_stop`` does with it (``resilient
  launch``: wait for the other agents of the run to leave, so that their last calls
  succeed at once instead of retrying against a dead etcd).

With ``members`` above 1 (``launch.etcd_members`` 3 or 5; 1 by default) the owner's etcd is only the
first member: the agents that join grow it into a cluster of that many members, one per agent
(:mod:`resilient.control.members`), and from the third agent on losing any one agent leaves the
job training. With fewer agents the job depends on the first one (said at start), as with
``members = 1``, where the embedded etcd lives in its owner's process tree alone.
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

from resilient.control.api import ClaimSettings
from resilient.control.claim import CONTROL_DIR, RunDirClaim, control_dir
from resilient.control.members import ClusterMember, MemberSettings, voter_endpoints
from resilient.errors import LaunchError
from resilient.rundir import write_private

__all__ = ["embedded_etcd", "client_kwargs", "cluster_endpoints", "JOIN_CHECK", "AUTO_SYNC"]
# How often the clients of an embedded etcd ask it for its members (EtcdClient auto_sync): a
# member that joined is known to every client this long after, before another can be lost.
AUTO_SYNC = timedelta(seconds=5)
# How long a joining agent waits for the owner's etcd to answer its first request: the
# owner published only once its etcd answered, so this covers a restart by its watch.
JOIN_CHECK = timedelta(seconds=30)
TLS_DIR = "tls"


def _say(line: str) -> None:
    print(f"resilient: {line}", file=sys.stderr, flush=True)


def client_kwargs(conf: dict[str, str]) -> dict[str, str]:
    """The :class:`~resilient.etcd.EtcdClient` arguments of an embedded etcd's ``--rdzv-conf`` keys."""
    return {k: conf[k] for k in ("ca_cert", "cert", "key", "username", "password") if k in conf}


@contextlib.contextmanager
def embedded_etcd(run_dir: str | Path, secret, *, standalone: bool = False,
                  before_stop: Callable[[object], None] | None = None,
                  settings: ClaimSettings = ClaimSettings(), members: int | MemberSettings = 1,
                  node: str = "") -> Iterator[str]:
    """The endpoint(s) of ``run_dir``'s embedded etcd: this agent's own if its claim wins (then it
    runs for the life of the ``with``, and ``before_stop(etcd)`` runs at its end, the etcd still
    up), else the owner's (with ``members`` above 1, the cluster's voting members, this agent's
    own member among them once it joined). ``standalone``: always our own, shared with nobody
    (no claim, one member). ``node``: this agent's name in its member's name."""
    from resilient.etcd import EtcdAuthError, EtcdClient, EtcdError
    from resilient.etcd.server import embedded_etcd_conf

    # One dir per secret: an agent launched with another secret must not overwrite the files
    # the owner's etcd and workers read (it is refused below, but only after deriving its own).
    tls_dir = control_dir(run_dir) / f"{TLS_DIR}-{secret.fingerprint}"
    conf = embedded_etcd_conf(secret, tls_dir)   # the CA and our client certificate, derived
    msettings = members if isinstance(members, MemberSettings) else MemberSettings(members=members)
    if standalone:
        with _own_etcd(secret, tls_dir) as etcd:
            yield etcd.endpoint
        return
    node = node or f"agent-{os.getpid()}"
    claim = RunDirClaim(run_dir, secret, settings, _say)
    owner = claim.join()
    if owner is not None:
        try:
            with EtcdClient(owner.endpoint, retry_timeout=JOIN_CHECK, **client_kwargs(conf)) as c:
                c.check(JOIN_CHECK)   # logs in first: the certificate and the password are checked here
        except EtcdAuthError as e:
            raise LaunchError(
                f"the embedded etcd at {owner.endpoint} (agent pid {owner.pid}, {claim.record_path}) refused this "
                f"node: this node has another job secret (fingerprint {secret.fingerprint}) than the agent that "
                f"started it. Give every node of the job the same secret (by default the run dir's "
                f"{Path(run_dir) / 'job.secret'}). ({e})") from None
        except EtcdError as e:
            raise LaunchError(
                f"the embedded etcd at {owner.endpoint}, owned by agent pid {owner.pid}, does not answer ({e}). "
                f"That agent is alive: check it (`ps -o pid,stat,args -p {owner.pid}`); if it is stuck, stop it "
                f"and launch every node of the run again") from None
        _say(f"joined the embedded etcd at {owner.endpoint} of agent pid {owner.pid} (run dir {run_dir})")
        if msettings.members <= 1:
            yield owner.endpoint
            return
        with _join_cluster(owner.endpoint, run_dir, conf, secret, tls_dir, node, msettings) as endpoints:
            yield endpoints
        return
    try:
        cluster = msettings.members > 1
        # The claim's last owner is gone, but the cluster it started may live on in the agents
        # that joined it (issue 38: no node is special): join it, never start a second one.
        alive = _live_cluster(run_dir, secret, conf) if cluster else None
        if alive is not None:
            claim.publish(alive.split(",")[0])
            _say(f"the run dir's etcd cluster ({alive}) outlived the agent that started it; this agent joins it")
            with _join_cluster(alive, run_dir, conf, secret, tls_dir, node, msettings) as endpoints:
                yield endpoints
            return
        with _own_etcd(secret, tls_dir, election_ms=msettings.election_ms if cluster else None) as etcd:
            claim.publish(etcd.endpoint)
            member = _cluster_member(etcd.endpoint, run_dir, conf, secret, tls_dir, node, msettings) if cluster else None
            if member is not None:
                member.mark(member.client.member_id())
                member.changed()
                member.start_tending()
            _say(f"embedded etcd at {etcd.endpoint}, with client TLS and authentication from the job secret (other "
                 "agents on this machine: the same --run-dir, started in any order). " + (
                     f"It grows into a cluster of {msettings.members} members as agents join (launch.etcd_members); "
                     f"until {msettings.members} agents run, the job depends on this first agent: losing it ends "
                     "the job for every node, keeping what was committed" if cluster else
                     "It lives in this agent: losing this node ends the job for every node "
                     "(launch.etcd_members = 3, or an etcd cluster through --rdzv-endpoint, has no such node)"))
            try:
                yield etcd.endpoint
            finally:
                if before_stop is not None:
                    before_stop(etcd)
                if member is not None:
                    member.leave()
                    member.client.close()
    finally:
        claim.release()


@contextlib.contextmanager
def _join_cluster(endpoint: str, run_dir, conf: dict[str, str], secret, tls_dir: Path, node: str,
                  msettings: MemberSettings) -> Iterator[str]:
    """Add this agent's member to the cluster at ``endpoint`` (when it has room), tend it, and
    yield the voting members' endpoints; remove the member at the end."""
    from resilient.etcd import EtcdError

    member = _cluster_member(endpoint, run_dir, conf, secret, tls_dir, node, msettings)
    try:
        try:
            member.join()
        except (EtcdError, LaunchError) as e:
            _say(f"this agent runs no etcd member ({e}); it is a client of the run dir's etcd cluster")
        member.start_tending()
        yield voter_endpoints(member.client.members()) or endpoint
    finally:
        member.leave()
        member.client.close()


MEMBERS = "members.json"            # the voting members' endpoints, sealed: what a new claimant joins
MEMBERS_PURPOSE = "control-plane-members"


def _write_members(run_dir, secret, members: list[dict]) -> None:
    endpoints = voter_endpoints(members)
    if endpoints:
        write_private(control_dir(run_dir) / MEMBERS, secret.seal_record(
            MEMBERS_PURPOSE, f"{CONTROL_DIR}/{MEMBERS}", {"endpoints": endpoints.split(",")}))


def cluster_endpoints(run_dir, secret) -> list[str]:
    """The voting members' client endpoints in the run dir's sealed members record (written
    by the members as they change); [] without one, or when it fails its MAC (not ours)."""
    from resilient.secret import Unauthentic

    try:
        raw = (control_dir(run_dir) / MEMBERS).read_bytes()
        return [str(e) for e in secret.open_record(MEMBERS_PURPOSE, f"{CONTROL_DIR}/{MEMBERS}", raw)["endpoints"]]
    except (OSError, Unauthentic, KeyError, TypeError):
        return []


def _live_cluster(run_dir, secret, conf: dict[str, str]) -> str | None:
    """The endpoints of the run dir's etcd cluster (its sealed members record) when a majority
    of it still answers (a quorum read), else None: none, stale, or not ours."""
    from resilient.etcd import EtcdClient, EtcdError

    endpoints = cluster_endpoints(run_dir, secret)
    if len(endpoints) < 2:
        return None   # a lone member died with its agent
    try:
        with EtcdClient(",".join(endpoints), retry_timeout=timedelta(seconds=5), request_timeout=timedelta(seconds=3),
                        **client_kwargs(conf)) as c:
            c.revision()   # linearizable: answered only by a cluster with a quorum
            answered = endpoints[c._current % len(endpoints)]
    except EtcdError:
        return None
    return ",".join([answered, *(e for e in endpoints if e != answered)])   # the record names one that answered


def _cluster_member(endpoint: str, run_dir, conf: dict[str, str], secret, tls_dir: Path, node: str,
                    settings: MemberSettings) -> ClusterMember:
    from resilient.etcd import EtcdClient

    def make_etcd(name: str, join: list[tuple[str, str]]):
        return _new_etcd(secret, tls_dir, settings.election_ms, name=name, join=join)

    def probe(url: str) -> EtcdClient:
        return EtcdClient(url, retry_timeout=settings.probe, request_timeout=settings.probe, **client_kwargs(conf))

    # A short retry budget: its calls are reconfigurations and looks, each retried on its own
    # terms; at exit, a cluster without quorum must not hold the agent for long.
    client = EtcdClient(endpoint, auto_sync=AUTO_SYNC, retry_timeout=timedelta(seconds=10), **client_kwargs(conf))
    return ClusterMember(client, node, make_etcd, probe, settings, _say,
                         on_change=lambda members: _write_members(run_dir, secret, members))


def _new_etcd(secret, tls_dir: Path, election_ms: int | None = None, **kw):
    """An unstarted member of this run's embedded etcd: its login and TLS from the job secret;
    ``election_ms``: a cluster's election timeout (one member keeps EmbeddedEtcd's own)."""
    from resilient.etcd import EmbeddedEtcd
    from resilient.etcd.server import embedded_tls

    extra = [f"--election-timeout={election_ms}"] if election_ms else []
    return EmbeddedEtcd(root_password=secret.etcd_password, tls=embedded_tls(secret, tls_dir, server=True),
                        extra_args=extra, **kw)


@contextlib.contextmanager
def _own_etcd(secret, tls_dir: Path, election_ms: int | None = None):
    with _new_etcd(secret, tls_dir, election_ms) as etcd:
        def restarted(code: int | None, seconds: float) -> None:
            _say(f"the embedded etcd at {etcd.endpoint} died (exit code {code}); restarted it on the same ports "
                 f"and data in {seconds:.1f} s, the job goes on")

        etcd.watch(on_restart=restarted)
        yield etcd
