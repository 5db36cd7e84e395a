"""Another local user against the embedded etcd of ``resilient launch`` (issue 39, item 3).

Before: etcd 3.4/3.5's NOSPACE-alarm gap let an anonymous client on the host raise the
alarm, turn authentication off, and clear the alarm; the job then died (`authentication is
not enabled`), and its etcd was open to everyone. Anonymous clients could also list, grant
and keep alive leases. Now the embedded etcd requires a client certificate signed by a CA
derived from the job secret, on its client port and on its raft port.

Here a real unprivileged user (tests/attackutil.py), with the system Python and no secret,
knowing the ports (loopback ports are easy to find), tries the NOSPACE alarm, ``auth
disable``, lease grant / list / keep-alive and a read: in plain HTTP, in TLS without a
certificate, and in TLS with a certificate of its own CA (made with ``openssl``); and the
raft port; and reading the TLS files. Every attempt is refused before a request is read
(at TLS), and the etcd of the launch's own code path (:func:`resilient.control.plane.
embedded_etcd`) is unaffected: no alarm, authentication still on, the job's key and lease
intact. And the client of an etcd whose authentication was turned off says so with a typed
error (:class:`~resilient.etcd.EtcdAuthDisabled`), never a traceback.
"""

from __future__ import annotations

import json
from datetime import timedelta

import psutil
import pytest

from resilient.control.plane import client_kwargs, embedded_etcd
from resilient.etcd import EtcdAuthDisabled, EtcdAuthError, EtcdClient
from resilient.etcd.server import ROOT_USER, EmbeddedEtcd, embedded_etcd_conf
from resilient.secret import JobSecret

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

SECRET = JobSecret(b"the attacked job's secret, of 32 bytes or more")

ATTACK = r"""
import atexit, glob, http.client, json, os, shutil, ssl, subprocess, sys, tempfile

client_port, peer_port, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
HOST = "127.0.0.1"
CALLS = {
    "NOSPACE alarm": ("/v3/maintenance/alarm", {"action": "ACTIVATE", "memberID": 0, "alarm": "NOSPACE"}),
    "auth disable": ("/v3/auth/disable", {}),
    "lease grant": ("/v3/lease/grant", {"TTL": 600}),
    "lease list": ("/v3/lease/leases", {}),
    "lease keep-alive": ("/v3/lease/keepalive", {"ID": "1"}),
    "read every key": ("/v3/kv/range", {"key": "AA==", "range_end": "AA=="}),
}

def own_certificate():
    # A CA and a client certificate of the attacker's own (the job's CA is derived from a secret it lacks).
    if shutil.which("openssl") is None:
        return None
    d = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, d, True)   # the test leaves nothing behind, the attacker's files included
    key, cert = os.path.join(d, "k.pem"), os.path.join(d, "c.pem")
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", key, "-out", cert, "-days", "1", "-subj", "/O=resilient/OU=resilient-client"],
                       capture_output=True)
    return (cert, key) if r.returncode == 0 else None

def ask(port, method, path, body, mode, cert=None):
    try:
        if mode == "http":
            c = http.client.HTTPConnection(HOST, port, timeout=5)
        else:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE   # trusts any server: wants in
            if cert:
                ctx.load_cert_chain(*cert)
            c = http.client.HTTPSConnection(HOST, port, context=ctx, timeout=5)
        c.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        r = c.getresponse()
        return f"HTTP {r.status}: {r.read()[:160]!r}"
    except Exception as e:
        return f"refused: {type(e).__name__}: {e}"

mine = own_certificate()
out = {"own certificate": mine is not None}
for name, (path, body) in CALLS.items():
    out[name] = {"http": ask(client_port, "POST", path, body, "http"),
                 "tls": ask(client_port, "POST", path, body, "tls"),
                 **({"tls+own cert": ask(client_port, "POST", path, body, "tls", mine)} if mine else {})}
for name, path in (("raft members", "/members"), ("raft lease renew", "/leases")):
    out[name] = {"http": ask(peer_port, "GET", path, None, "http"), "tls": ask(peer_port, "GET", path, None, "tls"),
                 **({"tls+own cert": ask(peer_port, "GET", path, None, "tls", mine)} if mine else {})}
files = {}
for pattern in ("control/tls-*/client.key", "control/tls-*/server.key", "control/tls-*/ca.pem", "job.secret"):
    try:
        found = glob.glob(os.path.join(run_dir, pattern)) or [os.path.join(run_dir, pattern)]
        with open(found[0], "rb") as f:
            files[pattern] = "read %d bytes" % len(f.read())
    except OSError as e:
        files[pattern] = f"refused: {type(e).__name__}"
out["files"] = files
print(json.dumps(out))
"""


def etcd_ports(endpoint: str) -> tuple[int, int]:
    """The client and raft ports of this process's embedded etcd (from its command line)."""
    for p in psutil.Process().children(recursive=True):
        cmd = p.cmdline()
        if any(a == f"--listen-client-urls=https://{endpoint}" for a in cmd):
            peer = next(a for a in cmd if a.startswith("--listen-peer-urls="))
            return int(endpoint.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])
    raise AssertionError(f"no etcd child serving {endpoint}")


def test_another_user_cannot_reach_the_embedded_etcd_at_all(attacker, public_tmp):
    run_dir = public_tmp / "run"
    with embedded_etcd(run_dir, SECRET) as endpoint, \
            EtcdClient(endpoint, retry_timeout=timedelta(seconds=10), **client_kwargs(embedded_etcd_conf(SECRET))) as job:
        job.put("/resilient/job/k", "v")
        lease = job.grant(timedelta(seconds=120))
        client_port, peer_port = etcd_ports(endpoint)
        got = attacker.python(ATTACK, str(client_port), str(peer_port), str(run_dir))
        assert got.returncode == 0, got.stderr[-3000:]
        out = json.loads(got.stdout)
        # The etcd is unaffected: no alarm raised, authentication on (a certificate alone, without
        # the login, reads nothing), the job's key and lease there.
        alarms = job._post("/maintenance/alarm", {"action": "GET"}, "list alarms").get("alarms")
        assert not alarms, alarms
        assert job.get("/resilient/job/k").value == b"v"
        conf = client_kwargs(embedded_etcd_conf(SECRET))
        with EtcdClient(endpoint, ca_cert=conf["ca_cert"], cert=conf["cert"], key=conf["key"],
                        retry_timeout=timedelta(seconds=2)) as no_login:
            with pytest.raises(EtcdAuthError):
                no_login.get("/resilient/job/k")
        leases = job._post("/lease/leases", {}, "list leases").get("leases") or []
        assert [int(x["ID"]) for x in leases] == [lease], leases   # ours, and none of the attacker's
    calls = {k: v for k, v in out.items() if k not in ("files", "own certificate")}
    assert len(calls) == 8
    for name, modes in calls.items():
        assert "HTTP request to an HTTPS server" in modes["http"] or modes["http"].startswith("refused"), (name, modes)
        assert modes["tls"].startswith("refused"), (name, modes)
        if out["own certificate"]:
            assert modes["tls+own cert"].startswith("refused"), (name, modes)
    assert all(v.startswith("refused: PermissionError") for v in out["files"].values()), out["files"]


def test_a_server_whose_authentication_was_turned_off_is_a_typed_error():
    """An etcd (an external one, password auth only) whose authentication someone turned off:
    a client that logs in is told so, typed (EtcdAuthDisabled, an EtcdAuthError), not crashed."""
    with EmbeddedEtcd(root_password=SECRET.etcd_password) as server:
        with server.client(retry_timeout=timedelta(seconds=5)) as root:
            root.put("/k", "v")
            root._post("/auth/disable", {}, "disable authentication")   # what the NOSPACE gap allowed anyone
        with EtcdClient(server.endpoint, username=ROOT_USER, password=SECRET.etcd_password,
                        retry_timeout=timedelta(seconds=5)) as c:
            with pytest.raises(EtcdAuthDisabled, match="authentication is not enabled") as info:
                c.get("/k")
    assert isinstance(info.value, EtcdAuthError) and "NOSPACE" in str(info.value)
