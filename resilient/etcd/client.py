"""A thin, typed etcd v3 client over etcd's JSON gateway that rides through outages.

Why our own (over :mod:`.transport`, plain ``http.client``) and not ``etcd3gw``:

* ``etcd3gw`` speaks to one endpoint, raises untyped errors, has no
  compare-and-swap on ``mod_revision`` (only a raw ``txn``), no
  username/password authentication and no lease keep-alive. A rendezvous, an
  agent's liveness lease and the snapshot commit records need all of these.
  And its ``requests`` transport cost ~5x the client CPU per request
  (:mod:`.transport`), paid every training step by the snapshot replicator.
* A training run must not die because etcd restarted or lost its leader for
  a second. Every request here is retried with exponential backoff, across
  all configured endpoints, for at most ``retry_timeout``; only then does it
  raise :class:`~resilient.etcd.api.EtcdUnavailable`, naming the endpoints and
  how to check them. The first contact (:meth:`EtcdClient.check`) has its own
  short bound, so a wrong endpoint fails fast instead of hanging.
* Every duration is a :class:`datetime.timedelta`.

We talk to etcd's v3 JSON gateway at ``/v3/`` (etcd >= 3.4; 3.3 served it
at ``/v3beta/`` and is end-of-life), so no gRPC or protobuf pin is needed.
The gateway has no streaming keep-alive, hence the refresh thread of
:class:`~resilient.etcd.lease.Lease`.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar


from resilient.etcd.api import (
    EtcdAuthDisabled,
    EtcdAuthError,
    EtcdError,
    EtcdFull,
    EtcdLeaseExpired,
    EtcdUnavailable,
    KeyValue,
)
from resilient.etcd.endpoints import DEFAULT_PORT, parse_endpoints  # noqa: F401  (re-exported)
from resilient.etcd.lease import Lease, LivenessLease  # noqa: F401  (LivenessLease: re-exported)
from resilient.etcd.transport import Gateway, ServerBusy, TransportError, Unreachable, tls_context

__all__ = [
    "EtcdClient",
    "CasResult",
    "Lease",
    "LivenessLease",
    "parse_endpoints",
    "voter_urls",
    "DEFAULT_PORT",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Transport-level failures worth retrying: the server is down, restarting,
# has no leader yet (503), or timed out. Everything else is a real answer.
_AUTH_MARKERS = ("auth", "permission denied", "user name is empty", "token")

_TLS_MARKERS = ("SSLError", "CERTIFICATE_VERIFY_FAILED", "certificate required", "bad certificate")

_RETRYABLE = (Unreachable, ServerBusy)
TLS_EOFS = 3   # see EtcdClient._call


def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode("ascii")


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _range(prefix: bytes | str) -> dict[str, str]:
    """Range request fields covering every key that starts with ``prefix``."""
    p = prefix.encode() if isinstance(prefix, str) else prefix
    return {"key": _b64(p or b"\0"), "range_end": _b64(_prefix_end(p))}


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw.get("key")),
        value=_unb64(raw.get("value")),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def _response(resp: dict[str, Any], kind: str) -> dict[str, Any]:
    # The 3.4 gateway emits snake_case names; accept camelCase too.
    camel = "response" + kind[0].upper() + kind[1:]
    return resp.get("response_" + kind) or resp.get(camel) or {}


@dataclass(frozen=True)
class CasResult:
    """Outcome of a compare-and-swap.

    ``kv`` is the key as it is *now*: the value just written when
    ``succeeded``, otherwise the current value that beat us (``None`` when
    the key does not exist). Read atomically with the comparison, so a loser
    can retry from ``kv.mod_revision`` without another round trip.
    """

    succeeded: bool
    kv: KeyValue | None


def voter_urls(members: list[dict[str, Any]]) -> list[str]:
    """The first client URL of each voting member in etcd's member list (a learner serves no
    request; a member added but not started has no client URL yet)."""
    return [u for m in members if not m.get("isLearner") for u in (m.get("clientURLs") or [])[:1]]


class EtcdClient:
    """Typed etcd v3 client: KV, compare-and-swap, leases; retries outages.

    Args:
        endpoints: ``"host:port[,host:port...]"`` or a list; URLs allowed.
        ca_cert, cert, key: TLS files (CA bundle; client certificate and key).
            Giving ``ca_cert`` or ``cert`` switches the default scheme to https.
        username, password: etcd user credentials (etcd's ``auth enable``).
        request_timeout: bound on one HTTP request.
        retry_timeout: how long a request keeps retrying while etcd is
            unreachable or leaderless before :class:`EtcdUnavailable`.
        auto_sync: every this long, replace the endpoints by the client URLs of the
            cluster's voting members (etcd's member list), as etcd's own clientv3
            does with ``AutoSyncInterval``. Why: the embedded etcd of ``resilient
            launch`` grows from one member to several while the job runs
            (:mod:`resilient.control.members`); a client that knew only the first
            member would die with it. None (the default): the endpoints given stay,
            as an operator's cluster behind a proxy or a load balancer needs.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        username: str | None = None,
        password: str | None = None,
        request_timeout: timedelta = timedelta(seconds=5),
        retry_timeout: timedelta = timedelta(seconds=30),
        auto_sync: timedelta | None = None,
    ) -> None:
        for name, value in (("request_timeout", request_timeout), ("retry_timeout", retry_timeout),
                            ("auto_sync", auto_sync or timedelta(0))):
            if not isinstance(value, timedelta):
                raise TypeError(f"{name} must be a datetime.timedelta, not {value!r}")
        if bool(cert) != bool(key):
            raise EtcdError("TLS client auth needs both a certificate and its key (cert= and key=)")
        if bool(username) != (password is not None):
            raise EtcdError("etcd authentication needs both a username and a password")
        # A client certificate together with a username/password works when the certificate has
        # no common name (the embedded etcd's: resilient.etcd.pki); etcd's gateway refuses a
        # request whose certificate names one ("CommonName ... will be ignored"): said at login.
        self.request_timeout = request_timeout
        self.retry_timeout = retry_timeout
        self._username = username
        self._password = password
        self._token: str | None = None  # etcd auth token, sent to every endpoint
        default_scheme = "https" if (ca_cert or cert) else "http"
        context = tls_context(ca_cert, cert, key) if any(s == "https" or (not s and default_scheme == "https")
                                                          for s, _, _ in parse_endpoints(endpoints)) else None
        self._context, self._default_scheme = context, default_scheme
        # etcd >= 3.4 serves the gateway at /v3/ (no version discovery round trip).
        self._gw: list[Gateway] = [Gateway(scheme or default_scheme, host, port, request_timeout, context)
                                   for scheme, host, port in parse_endpoints(endpoints)]
        self.endpoints: list[str] = [gw.base_url for gw in self._gw]
        self._current = 0
        self.auto_sync = auto_sync
        self._synced = 0.0 if auto_sync is None else time.monotonic()
        self._auth_lock = threading.Lock()
        self._leases: list[Lease] = []
        self._closed = False
        # Called as on_request(gateway path, seconds) after each HTTP request, failed ones
        # too: the agent's metrics time etcd with it (resilient.agent.metrics).
        self.on_request: Callable[[str, float], None] | None = None

    # ------------------------------------------------------------ transport
    def _set_token(self, token: str | None) -> None:
        self._token = token
        for gw in self._gw:
            gw.set_token(token)

    def _authenticate(self, gw: Gateway, stale: str | None) -> None:
        """Log in and send the new token from now on, unless another thread already replaced
        ``stale`` (the token the caller's request was refused with; None: it had none yet).

        Why the token is never cleared while logging in: the client is shared by the agent's
        threads, and a request sent without a token over the client-certificate TLS of the
        embedded etcd is taken as from the certificate's (empty) common name and refused
        "permission denied" (etcd 3.4's AuthInfoFromTLS), which is not a reason to log in
        again: the other threads keep the stale token, are told "invalid auth token", and
        wait here for the one login (seen under load after an etcd restart:
        tests/integration/test_control_plane_faults.py)."""
        with self._auth_lock:
            if self._token != stale:
                return
            try:
                resp = gw.post("/auth/authenticate", {"name": self._username, "password": self._password},
                               with_token=False)
            except _RETRYABLE:
                raise
            except TransportError as exc:
                text = (exc.detail_text or str(exc)).strip()
                if "authentication is not enabled" in text:
                    raise EtcdAuthDisabled(gw.base_url, self._username) from None
                hint = (
                    "etcd's HTTP gateway refuses a client certificate with a common name (CN) "
                    "together with a username/password: use a certificate without a CN, or one "
                    "of the two (ca_cert alone is fine)"
                    if "CommonName" in text else
                    "check the username and password (`etcdctl user get NAME`) and that "
                    "auth is enabled on the cluster"
                )
                raise EtcdAuthError(
                    f"etcd at {gw.base_url} refused user {self._username!r}: {text}; {hint}"
                ) from None
            self._set_token(resp["token"])

    def _call(
        self,
        what: str,
        fn: Callable[[Gateway], _T],
        retry_timeout: timedelta | None = None,
    ) -> _T:
        """Run ``fn`` against an endpoint, failing over and backing off."""
        if self._closed:
            raise EtcdError(f"etcd {what}: the client is closed")
        budget = (self.retry_timeout if retry_timeout is None else retry_timeout).total_seconds()
        start = time.monotonic()
        delay = 0.02
        reauthed = relogin = False   # logged in again once in this call / to do before the next try
        refused_with: str | None = None   # the token the server refused
        used: str | None = None
        tls_eofs = 0   # TLS connections the server closed unfinished, in a row
        while True:
            gws = self._gw   # replaced whole by a sync: this call keeps the list it started with
            idx = self._current % len(gws)
            gw = gws[idx]
            try:
                if self._username and (self._token is None or relogin):
                    self._authenticate(gw, stale=refused_with if relogin else None)
                    relogin = False
                used = self._token
                out = fn(gw)
                if self.auto_sync is not None and time.monotonic() - self._synced >= self.auto_sync.total_seconds():
                    self._sync(gw)
                return out
            except _RETRYABLE as exc:
                last: object = exc.detail_text or exc or type(exc).__name__
                # A server that refuses our TLS (no client certificate, one it does not trust)
                # sends an alert, but under TLS 1.3 the client may be writing its request by
                # then and see only the connection closed (SSLEOFError): every try, for the
                # whole retry budget, on a loaded host. One such close is also what a server
                # stopping mid-handshake gives, so it takes TLS_EOFS in a row to be a refusal.
                tls_eofs = tls_eofs + 1 if "SSLEOFError" in str(last) else 0
                if any(m in str(last) for m in _TLS_MARKERS) or tls_eofs >= TLS_EOFS:
                    # A TLS failure is a configuration problem, not an outage: no retry.
                    raise EtcdAuthError(
                        f"etcd {what}: TLS with {gw.base_url} failed: {last}. Check ca_cert "
                        "(the CA that signed etcd's certificate), cert/key (a client "
                        "certificate etcd trusts) and that the endpoint uses https."
                    ) from None
                self._current = (idx + 1) % len(gws)
                waited = time.monotonic() - start
                if waited >= budget:
                    raise EtcdUnavailable(self.endpoints, waited, f"{what}: {last}") from None
                time.sleep(min(delay, max(0.0, budget - waited)))
                delay = min(delay * 2, 1.0)
            except TransportError as exc:
                text = exc.detail_text or str(exc)
                auth_problem = any(m in text.lower() for m in _AUTH_MARKERS)
                if self._username and not reauthed and ("token" in text.lower() or "user name is empty" in text
                                                        or "permission denied" in text):
                    # Simple tokens expire (default 5 min), and an etcd that restarted has forgotten
                    # them ("invalid auth token"; "user name is empty" where a request reaches it
                    # without one). Log in again once (or take the token another thread just got);
                    # a user who really lacks the permission is refused again, and told.
                    reauthed = relogin = True
                    refused_with = used
                    continue
                if self._username and "authentication is not enabled" in text:
                    raise EtcdAuthDisabled(gw.base_url, self._username) from None
                if "database space exceeded" in text:
                    raise EtcdFull(what, gw.base_url) from None
                if "lease not found" in text:
                    raise EtcdLeaseExpired(
                        f"etcd {what} at {gw.base_url}: the lease is gone (expired or "
                        "revoked); grant a new one and re-register the keys it held"
                    ) from None
                if auth_problem:
                    hint = (
                        "grant the user a role covering this key range (`etcdctl role grant-permission`)"
                        if self._username else
                        "this cluster has authentication enabled: pass username and password "
                        "(rdzv conf username=..., password=... or RESILIENT_ETCD_PASSWORD)"
                    )
                    raise EtcdAuthError(f"etcd {what} at {gw.base_url} was refused: {text}; {hint}") from None
                raise EtcdError(f"etcd {what} at {gw.base_url} failed: {text}") from None

    def _post(self, path: str, body: dict[str, Any], what: str,
              retry_timeout: timedelta | None = None) -> dict[str, Any]:
        return self._call(what, lambda gw: self._timed_post(gw, path, body), retry_timeout)

    def _timed_post(self, gw: Gateway, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.on_request is None:
            return gw.post(path, body)
        start = time.monotonic()
        try:
            return gw.post(path, body)
        finally:
            self.on_request(path, time.monotonic() - start)

    # ------------------------------------------------------------ the cluster's members
    def _sync(self, gw: Gateway) -> None:
        """Take the voting members' client URLs as the endpoints (``auto_sync``), asked of
        ``gw`` (which just answered). A learner is left out: it serves no request. A failed
        or empty answer keeps the endpoints as they are (the next request asks again)."""
        self._synced = time.monotonic()
        try:
            members = gw.post("/cluster/member/list", {}).get("members") or []
        except TransportError as e:
            log.debug("etcd member list from %s failed: %s", gw.base_url, e)
            return
        urls = voter_urls(members)
        if not urls or sorted(urls) == sorted(self.endpoints):
            return
        have = {g.base_url: g for g in self._gw}
        fresh: list[Gateway] = []
        for scheme, host, port in parse_endpoints(urls):
            shown = f"[{host}]" if ":" in host else host
            url = f"{scheme or self._default_scheme}://{shown}:{port}"
            g = have.pop(url, None)
            if g is None:
                g = Gateway(scheme or self._default_scheme, host, port,
                            timedelta(seconds=gw.timeout), self._context)
                g.set_token(self._token)
            fresh.append(g)
        current = gw.base_url
        self._gw, self.endpoints = fresh, [g.base_url for g in fresh]
        self._current = next((i for i, g in enumerate(fresh) if g.base_url == current), 0)
        for gone in have.values():   # members removed: their connections are of no more use
            gone.close()
        log.info("etcd endpoints now %s (the cluster's voting members)", ",".join(self.endpoints))

    def endpoint_list(self) -> str:
        """The endpoints as ``--rdzv-endpoint`` takes them (comma-separated URLs): for a process
        started now, the members this client knows of (after ``auto_sync``, the current ones)."""
        return ",".join(self.endpoints)

    def members(self) -> list[dict[str, Any]]:
        """The cluster's members as etcd lists them: ``ID`` (a decimal string), ``name``,
        ``peerURLs``, ``clientURLs`` (empty until the member started), ``isLearner``."""
        return list(self._post("/cluster/member/list", {}, "member list").get("members") or [])

    def member_add(self, peer_urls: Sequence[str], learner: bool = True) -> dict[str, Any]:
        """Add a member (a learner by default: it counts for no quorum until promoted); the
        new member's record (its ``ID``) and the members as etcd lists them after it."""
        try:
            resp = self._post("/cluster/member/add", {"peerURLs": list(peer_urls), "isLearner": learner},
                              f"member add {list(peer_urls)}", retry_timeout=timedelta(seconds=10))
        except EtcdError as e:
            # A retry of an add the cluster had applied, its answer lost to the request timeout
            # (a loaded host): "member ID already exist" / "Peer URLs already exists". The member
            # with these peer URLs is the one added (the caller chose free ports for it).
            if isinstance(e, EtcdAuthError) or "already exist" not in str(e):
                raise
            mine = [m for m in self.members() if sorted(m.get("peerURLs") or []) == sorted(peer_urls)]
            if not mine:
                raise
            return mine[0]
        return resp.get("member") or {}

    def member_promote(self, member_id: int | str) -> None:
        """Make a learner a voting member; etcd refuses (:class:`EtcdError`) one that has not
        caught up with the leader yet."""
        self._post("/cluster/member/promote", {"ID": str(member_id)}, f"member promote {member_id}",
                   retry_timeout=timedelta(seconds=10))

    def member_remove(self, member_id: int | str, retry_timeout: timedelta | None = None) -> None:
        """Remove a member from the cluster (it stops serving, and stops counting for quorum)."""
        self._post("/cluster/member/remove", {"ID": str(member_id)}, f"member remove {member_id}", retry_timeout)

    def member_id(self) -> int:
        """The ID of the member this client's current endpoint is (its status header's)."""
        resp = self._call("status", lambda gw: gw.post("/maintenance/status", {}))
        return int((resp.get("header") or {})["member_id"])

    # ------------------------------------------------------------ health
    def check(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Fail fast with :class:`EtcdUnavailable` unless etcd answers within ``timeout``.

        Call this once at start: a wrong ``--rdzv-endpoint`` or a stopped
        cluster then shows up as a clear error, not a long hang.

        A server that timed out (no answer within the request timeout, as opposed to a
        refused connection or an unknown host) gets the client's ``retry_timeout`` in all:
        it may be there and slow. Why: on a loaded host (the suite beside two busy loops) an
        embedded etcd the launcher had just started and secured missed the 5 s once, and the
        launch ended "cannot reach etcd". A blackholed endpoint is then named after
        ``retry_timeout`` instead of ``timeout``.
        """
        start = time.monotonic()
        try:
            self._post("/maintenance/status", {}, "status check", retry_timeout=timeout)
        except EtcdUnavailable as e:
            rest = self.retry_timeout.total_seconds() - (time.monotonic() - start)
            if "timed out" not in str(e) or rest <= 0:
                raise
            self._post("/maintenance/status", {}, "status check", retry_timeout=timedelta(seconds=rest))

    # ------------------------------------------------------------ KV
    def get(self, key: bytes | str) -> KeyValue | None:
        """The key's value and revisions, or ``None`` if it does not exist."""
        resp = self._post("/kv/range", {"key": _b64(key)}, f"get {key!r}")
        kvs = resp.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    # etcd refuses a transaction of more operations than its --max-txn-ops (default 128).
    MAX_TXN_OPS = 128

    def get_many(self, keys: Sequence[bytes | str]) -> list[KeyValue | None]:
        """Read several keys in one round trip (a compare-less txn) per :attr:`MAX_TXN_OPS`
        keys; each batch is read at one revision."""
        return self.get_many_at(keys)[0]

    def get_many_at(self, keys: Sequence[bytes | str]) -> tuple[list[KeyValue | None], int | None]:
        """:meth:`get_many`, and the revision of the read when it took one request (a watch
        from it misses nothing: resilient.etcd.watch); None when it took several."""
        out: list[KeyValue | None] = []
        revision = None
        for i in range(0, len(keys), self.MAX_TXN_OPS):
            resp = self.txn([], [{"request_range": {"key": _b64(k)}} for k in keys[i:i + self.MAX_TXN_OPS]], [])
            out += [_kv(kvs[0]) if kvs else None
                    for kvs in (_response(r, "range").get("kvs") for r in resp.get("responses") or [])]
            revision = (int((resp.get("header") or {}).get("revision", 0)) or None) if i == 0 else None
        return out, revision

    def get_prefix(self, prefix: bytes | str) -> list[KeyValue]:
        """All keys starting with ``prefix``, in key order."""
        resp = self._post("/kv/range", _range(prefix), f"get prefix {prefix!r}")
        return [_kv(kv) for kv in resp.get("kvs") or []]

    def prefix_since(self, prefix: bytes | str, since: int) -> tuple[int, list[KeyValue], int]:
        """(keys under ``prefix``, those of them modified after revision ``since`` with their
        values, the cluster's revision of the read), in one request at one revision: what a
        cached read of the prefix must apply to be current (plus deletions, which the count
        tells: :meth:`prefix_keys`)."""
        ops = [{"request_range": {**_range(prefix), "count_only": True}},
               {"request_range": {**_range(prefix), "min_mod_revision": int(since) + 1}}]
        resp = self.txn([], ops, [])
        reads = [_response(r, "range") for r in resp.get("responses") or []] + [{}, {}]
        return (int(reads[0].get("count", 0)), [_kv(kv) for kv in reads[1].get("kvs") or []],
                int(resp["header"]["revision"]))

    def prefix_keys(self, prefix: bytes | str) -> list[bytes]:
        """The keys under ``prefix``, without their values."""
        resp = self._post("/kv/range", {**_range(prefix), "keys_only": True}, f"list keys {prefix!r}")
        return [_unb64(kv.get("key")) for kv in resp.get("kvs") or []]

    def count_prefix(self, prefix: bytes | str) -> int:
        body = {**_range(prefix), "count_only": True}
        return int(self._post("/kv/range", body, f"count {prefix!r}").get("count", 0))

    def put(self, key: bytes | str, value: bytes | str, *, lease: int | Lease | None = None) -> int:
        """Write ``key``; returns the revision of the write (its new ``mod_revision``)."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = int(lease.id if isinstance(lease, Lease) else lease)
        resp = self._post("/kv/put", body, f"put {key!r}")
        return int(resp["header"]["revision"])

    def delete(self, key: bytes | str) -> bool:
        """Delete ``key``; ``True`` if it existed."""
        resp = self._post("/kv/deleterange", {"key": _b64(key)}, f"delete {key!r}")
        return int(resp.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: bytes | str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        return int(self._post("/kv/deleterange", _range(prefix), f"delete prefix {prefix!r}").get("deleted", 0))

    def revision(self, key: bytes | str = "/resilient/") -> int:
        """The cluster's current revision (one count-only read of ``key``, which the user
        must be allowed to read)."""
        resp = self._post("/kv/range", {"key": _b64(key), "count_only": True}, "revision")
        return int(resp["header"]["revision"])

    def compact(self, revision: int) -> bool:
        """Drop the history of every key before ``revision`` (not the current values);
        False if it was already compacted that far (another agent did it first)."""
        try:
            self._post("/kv/compaction", {"revision": int(revision), "physical": False}, f"compact {revision}")
        except EtcdError as e:
            if "compacted" in str(e):
                return False
            raise
        return True

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict],
            retry_timeout: timedelta | None = None) -> dict[str, Any]:
        """A raw v3 transaction (gateway JSON; keys/values base64), retried for ``retry_timeout``
        (default: the client's) while etcd does not answer."""
        body = {"compare": compare, "success": success, "failure": failure}
        return self._post("/kv/txn", body, "txn", retry_timeout)

    def compare_and_swap(
        self,
        key: bytes | str,
        value: bytes | str,
        *,
        mod_revision: int | None,
        lease: int | Lease | None = None,
    ) -> CasResult:
        """Write ``key`` only if its ``mod_revision`` is still ``mod_revision``.

        ``mod_revision=None`` (or 0) means "only if the key does not exist".
        The current value comes back in the same transaction either way.
        """
        k = _b64(key)
        if mod_revision:
            cmp = {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": int(mod_revision)}
        else:
            cmp = {"key": k, "target": "VERSION", "result": "EQUAL", "version": 0}
        return self._cas(key, cmp, value, lease)

    def compare_value_and_swap(
        self, key: bytes | str, expected: bytes | str, value: bytes | str,
        *, lease: int | Lease | None = None,
    ) -> CasResult:
        """Write ``key`` only if its current value equals ``expected``."""
        cmp = {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        return self._cas(key, cmp, value, lease)

    def put_and_get_prefix(self, key: bytes | str, value: bytes | str, prefix: bytes | str,
                           newest_under: Sequence[bytes | str] = ()) -> tuple[list[KeyValue], list[KeyValue | None]]:
        """Write ``key``, then read every key under ``prefix`` and the greatest key under each
        of ``newest_under`` (None where there is none), in one round trip (one txn)."""
        ops: list[dict[str, Any]] = [{"request_put": {"key": _b64(key), "value": _b64(value)}},
                                     {"request_range": _range(prefix)}]
        ops += [{"request_range": {**_range(p), "limit": 1, "sort_order": "DESCEND", "sort_target": "KEY"}}
                for p in newest_under]
        got = [_response(r, "range").get("kvs") or [] for r in (self.txn([], ops, []).get("responses") or [])[1:]]
        got += [[]] * (len(ops) - 1 - len(got))
        return [_kv(kv) for kv in got[0]], [_kv(kvs[0]) if kvs else None for kvs in got[1:]]

    def create_all(self, items: dict[str, str]) -> bool:
        """Create every key of ``items`` in one transaction, only if none of them exists yet."""
        cmp = [{"key": _b64(k), "target": "VERSION", "result": "EQUAL", "version": 0} for k in items]
        puts = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in items.items()]
        return bool(self.txn(cmp, puts, []).get("succeeded", False))

    def _cas(self, key: bytes | str, cmp: dict, value: bytes | str,
             lease: int | Lease | None) -> CasResult:
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = int(lease.id if isinstance(lease, Lease) else lease)
        read = {"request_range": {"key": _b64(key)}}
        resp = self.txn([cmp], [{"request_put": put}, read], [read])
        ok = bool(resp.get("succeeded", False))
        responses = resp.get("responses") or []
        kvs = _response(responses[-1], "range").get("kvs") if responses else None
        return CasResult(ok, _kv(kvs[0]) if kvs else None)

    # ------------------------------------------------------------ leases
    def grant(self, ttl: timedelta) -> int:
        """Grant a bare lease (no keep-alive) and return its id."""
        secs = max(1, round(ttl.total_seconds()))
        return int(self._post("/lease/grant", {"TTL": secs}, "lease grant")["ID"])

    def lease(
        self,
        ttl: timedelta,
        *,
        keep_alive: bool = True,
        on_expired: Callable[[Lease], None] | None = None,
    ) -> Lease:
        """Grant a lease; with ``keep_alive`` a daemon thread refreshes it every ``ttl/3``.

        etcd deletes every key attached to a lease when it expires. The
        keep-alive thread is what makes "the key exists" mean "this process
        is alive": no etcd client keeps leases alive on its own.
        """
        lease = Lease(self, self.grant(ttl), ttl, on_expired)
        if keep_alive:
            lease.start_keep_alive()
        self._leases.append(lease)
        return lease

    def close(self) -> None:
        """Stop keep-alive threads (leases then lapse after their TTL) and the connections."""
        for lease in self._leases:
            lease.stop_keep_alive()
        self._leases.clear()
        self._closed = True
        for gw in self._gw:
            gw.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)})"
