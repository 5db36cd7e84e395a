"""Register the ``etcd3`` rendezvous with torch, in-process and for plain torchrun.

Two ways in, one creator:

* In-process (resilient's own agent, tests): call :func:`register` once,
  then ``--rdzv-backend etcd3`` / ``RendezvousParameters(backend="etcd3")``
  works with torch's ``get_rendezvous_handler``.
* Plain ``torchrun --rdzv-backend=etcd3``: torch loads the
  ``torchrun.handlers`` entry point ``etcd3`` and, in torch 2.13
  (``rendezvous/registry.py::_register_out_of_tree_handlers``), *calls the
  loaded object with no arguments* and registers what it returns as the
  creator. :func:`create_etcd3_handler` therefore answers a no-argument call
  with itself, and a call with ``RendezvousParameters`` with a handler.

``--rdzv-conf`` keys: :data:`RDZV_CONF` below (all optional; durations in seconds, floats
allowed), also listed by ``resilient config --explain``.

The shared TCP store trap (torch 2.13): by default the rank-0 agent hosts one
TCPStore that its workers reuse *across restarts* without a per-attempt
prefix, so restarted gloo workers read the previous attempt's addresses and
hang or fail. Unless ``share_tcp_store=true`` is given, creating an etcd3
handler sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in this (agent)
process, so each attempt's rank-0 worker hosts a fresh store.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousTimeout,
)

from resilient.contract import PASSWORD_ENV
from resilient.etcd.api import EtcdError, EtcdUnavailable
from resilient.etcd.client import EtcdClient, LivenessLease, parse_endpoints
from resilient.rendezvous.api import RendezvousConfigError, RendezvousError, RendezvousUnavailable
from resilient.rendezvous.handler import ResilientRendezvousHandler, install_fast_polling
from resilient.rendezvous.etcd3_backend import (
    DEFAULT_KEY_PREFIX,
    Etcd3RendezvousBackend,
    Etcd3Store,
)
from resilient.rendezvous.worker_exit import install_worker_exit_hook
from resilient.secret import require_secret

__all__ = ["BACKEND_NAME", "register", "create_etcd3_handler", "create_backend", "client_from_params", "etcd_client"]

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd3"
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass(frozen=True)
class ConfKey:
    """One ``--rdzv-conf`` key: its default (None: unset, the handler's own) and meaning."""

    name: str
    default: Any
    doc: str
    aliases: tuple[str, ...] = ()
    client: bool = False   # how to reach etcd (client_from_params): the workers need it too
    knob: bool = False     # one setting with the [launch] knob of its name (launch_args.RDZV_CONF_KNOBS)


# Every --rdzv-conf key this backend reads, and the defaults :func:`_seconds` and :func:`_opt`
# fall back on. Under `resilient launch`, join_timeout, last_call_timeout and keep_alive_interval
# are one setting with the [launch] knobs of the same name (torchrun's users pass them here): the
# knob sets the key, a key given sets the knob (resilient.launch_args.rdzv_conf_knobs), so the agent
# and the rendezvous never use two values; the embedded etcd's TLS and login keys are derived from
# the job secret.
RDZV_CONF: dict[str, ConfKey] = {k.name: k for k in (
    ConfKey("ca_cert", None, "CA bundle to verify etcd's TLS certificate (enables https)", ("cacert",), client=True),
    ConfKey("ssl_cert", None, "client certificate for etcd", ("cert",), client=True),
    ConfKey("ssl_cert_key", None, "the client certificate's key", ("key",), client=True),
    ConfKey("protocol", None, "http or https (default: https if any TLS file is given)", client=True),
    ConfKey("username", None, "etcd user; the password from password= or, out of ps, $RESILIENT_ETCD_PASSWORD",
            ("user",), client=True),
    ConfKey("password", None, "etcd password (prefer $RESILIENT_ETCD_PASSWORD)", client=True),
    ConfKey("key_prefix", DEFAULT_KEY_PREFIX, "etcd namespace of the rendezvous"),
    ConfKey("secret_file", None, "the job secret's file (mode 0600; default $RESILIENT_JOB_SECRET_FILE or "
                                 "$RESILIENT_JOB_SECRET): the state torch pickles is sealed with it"),
    ConfKey("lease_ttl", 60.0, "seconds: the liveness lease of the rendezvous keys"),
    ConfKey("connect_timeout", 5.0, "seconds: bound on the first contact with etcd"),
    ConfKey("request_timeout", 5.0, "seconds: bound on one etcd request", client=True),
    ConfKey("retry_timeout", 30.0, "seconds: how long requests ride through an etcd outage", client=True),
    ConfKey("auto_sync", None, "seconds between refreshes of the member list (unset: never)", client=True),
    ConfKey("store_timeout", 300.0, "seconds: bound on store waits and barriers"),
    ConfKey("join_timeout", None, "seconds: torch's join timeout (torch's default 600; under resilient launch "
                                  "one setting with launch.join_timeout)", knob=True),
    ConfKey("last_call_timeout", None, "seconds: torch's last call; with --nnodes MIN:MAX paid on every round "
                                       "(torch's default 30; under resilient launch one setting with "
                                       "launch.last_call_timeout)", knob=True),
    ConfKey("close_timeout", None, "seconds: torch's close timeout (torch's default 30)"),
    ConfKey("heartbeat_timeout", None, "seconds: torch's rendezvous heartbeat timeout, after which a silent node "
                                       "is dropped from the round (not the agent's worker heartbeat)"),
    ConfKey("keep_alive_interval", 5.0, "seconds between a node's rendezvous keep-alives (under resilient "
                                        "launch one setting with launch.keep_alive_interval)", knob=True),
    ConfKey("keep_alive_max_attempt", 3, "keep-alives a node may miss before the others drop it"),
    ConfKey("poll_interval", 0.1, "seconds between reads of the shared state by a joining or waiting node "
                                  "(torch's: 1)"),
    ConfKey("share_tcp_store", False, "true: keep torch's shared TCP store across restarts (unsafe with gloo "
                                      "restarts; see this module)"),
    ConfKey("destroy_at_exit", True, "each worker ends its default process group at exit if the script did not "
                                     "(torch 2.13 aborts now and then otherwise; resilient.rendezvous.worker_exit)"),
    ConfKey("handler", "torch", "torch (DynamicRendezvousHandler on one state key) or keys (a key per node, "
                                "for fleets of hundreds of nodes)"),
)}
_TABLE = object()   # _seconds: the default is RDZV_CONF's


def client_keys() -> frozenset[str]:
    """The --rdzv-conf keys (aliases too) that say how to reach etcd: TLS, login, timeouts."""
    return frozenset(n for k in RDZV_CONF.values() if k.client for n in (k.name, *k.aliases))


def explain_rdzv_conf() -> list[str]:
    """One line per key: ``name = default  # meaning``."""
    return [f"{k.name} = {k.default!r}  # {k.doc}" + (f" (alias: {', '.join(k.aliases)})" if k.aliases else "")
            for k in RDZV_CONF.values()]


def _seconds(params: RendezvousParameters, key: str, default: Any = _TABLE) -> timedelta | None:
    if default is _TABLE:
        default = RDZV_CONF[key].default
    value: Any = params.get(key, None)
    if value is None or value == "":
        return None if default is None else timedelta(seconds=default)
    if isinstance(value, timedelta):
        return value
    try:
        secs = float(value)
    except (TypeError, ValueError):
        raise RendezvousConfigError(
            f"rdzv config {key}={value!r} is not a number of seconds (e.g. {key}=5 or {key}=0.5)"
        ) from None
    if secs <= 0:
        raise RendezvousConfigError(f"rdzv config {key}={value!r} must be positive")
    return timedelta(seconds=secs)


def _opt(params: RendezvousParameters, *keys: str) -> str | None:
    for key in keys:
        value = params.get(key, None)
        if value not in (None, ""):
            return str(value)
    return None


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``k=v,k=v`` (a ``--rdzv-conf`` value) as a dict; a malformed item is :class:`RendezvousConfigError`."""
    conf = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise RendezvousConfigError(f"--rdzv-conf {item!r}: expected key=value")
        conf[key.strip()] = value.strip()
    return conf


def client_from_params(params: RendezvousParameters) -> EtcdClient:
    """An :class:`EtcdClient` from ``--rdzv-endpoint`` and the TLS/auth keys of ``--rdzv-conf``."""
    if not params.endpoint:
        raise RendezvousConfigError(
            "the etcd3 rendezvous needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
            "(resilient launch starts an embedded etcd when none is given)"
        )
    protocol = (_opt(params, "protocol") or "").lower()
    if protocol not in ("", "http", "https"):
        raise RendezvousConfigError(f"rdzv config protocol={protocol!r}: use http or https")
    ca_cert = _opt(params, "ca_cert", "cacert")
    cert = _opt(params, "ssl_cert", "cert")
    key = _opt(params, "ssl_cert_key", "key")
    if not protocol:
        protocol = "https" if (ca_cert or cert) else "http"
    try:
        endpoints = [
            f"{scheme or protocol}://" + (f"[{host}]" if ":" in host else host) + f":{port}"
            for scheme, host, port in parse_endpoints(params.endpoint)
        ]
        username = _opt(params, "username", "user")
        password = _opt(params, "password")
        if username and password is None:
            password = os.environ.get(PASSWORD_ENV)
            if password is None:
                raise RendezvousConfigError(
                    f"rdzv config username={username!r} needs a password: "
                    f"password=... in --rdzv-conf or the {PASSWORD_ENV} environment variable"
                )
        return EtcdClient(
            endpoints,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            username=username,
            password=password,
            request_timeout=_seconds(params, "request_timeout"),  # type: ignore[arg-type]
            retry_timeout=_seconds(params, "retry_timeout"),  # type: ignore[arg-type]
            auto_sync=_seconds(params, "auto_sync"),
        )
    except EtcdError as exc:
        raise RendezvousConfigError(str(exc)) from exc


def etcd_client(endpoint: str, conf: Mapping[str, Any] | None = None, run_id: str = "") -> EtcdClient:
    """The one way to reach a job's etcd outside a rendezvous (a worker's node store, the
    quarantine command): the endpoints and the TLS/auth/timeout keys of ``--rdzv-conf``,
    read as :func:`client_from_params` reads them for the rendezvous itself."""
    return client_from_params(RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id=run_id,
                                                   min_nodes=1, max_nodes=1, **dict(conf or {})))


def create_backend(params: RendezvousParameters) -> tuple[Etcd3RendezvousBackend, Etcd3Store]:
    """Connect to etcd (failing fast if unreachable) and build the backend and store."""
    secret = require_secret(_opt(params, "secret_file"), what=f"the etcd3 rendezvous of run {params.run_id!r}")
    client = client_from_params(params)
    try:
        client.check(_seconds(params, "connect_timeout"))  # type: ignore[arg-type]
    except EtcdUnavailable as exc:
        client.close()
        raise RendezvousUnavailable(f"etcd3 rendezvous for run {params.run_id!r}: {exc}") from exc
    except EtcdError as exc:  # credentials or TLS refused
        client.close()
        raise RendezvousError(f"etcd3 rendezvous for run {params.run_id!r}: {exc}") from exc
    prefix = (_opt(params, "key_prefix") or RDZV_CONF["key_prefix"].default).rstrip("/")
    lease = LivenessLease(client, _seconds(params, "lease_ttl"))  # type: ignore[arg-type]
    backend = Etcd3RendezvousBackend(client, params.run_id, key_prefix=prefix, lease=lease, secret=secret)
    store = Etcd3Store(
        client,
        f"{prefix}/{params.run_id}/store/",
        lease=lease,
        timeout=_seconds(params, "store_timeout"),  # type: ignore[arg-type]
    )
    return backend, store


def _create_handler(params: RendezvousParameters) -> Any:
    if not params.get_as_bool("share_tcp_store", RDZV_CONF["share_tcp_store"].default):
        if os.environ.get(SHARE_STORE_ENV) == "0":
            log.warning("%s=0 was set explicitly; the etcd3 rendezvous overrides it to 1 "
                        "(pass share_tcp_store=true to keep the shared store)", SHARE_STORE_ENV)
        os.environ[SHARE_STORE_ENV] = "1"
    if params.get_as_bool("destroy_at_exit", RDZV_CONF["destroy_at_exit"].default):
        install_worker_exit_hook()
    kind = _opt(params, "handler") or RDZV_CONF["handler"].default
    if kind not in ("torch", "keys"):
        raise RendezvousConfigError(f"--rdzv-conf handler={kind!r}: use 'torch' (one state key, the default) "
                                    "or 'keys' (a key per node, for large fleets)")
    backend, store = create_backend(params)
    if kind == "keys":
        return _keyed_handler(params, backend, store)
    timeout = RendezvousTimeout(
        join=_seconds(params, "join_timeout"),
        last_call=_seconds(params, "last_call_timeout"),
        close=_seconds(params, "close_timeout"),
        heartbeat=_seconds(params, "heartbeat_timeout"),
    )
    keep_alive = _seconds(params, "keep_alive_interval")
    attempts = params.get_as_int("keep_alive_max_attempt", RDZV_CONF["keep_alive_max_attempt"].default)
    handler = ResilientRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive.total_seconds(),  # type: ignore[arg-type,union-attr]
        keep_alive_max_attempt=attempts if attempts is not None else 3,
    )
    handler.poll = _seconds(params, "poll_interval")  # type: ignore[assignment]
    install_fast_polling()
    _guard_store(store, handler)
    return handler


def _guard_store(store: Etcd3Store, handler: Any) -> None:
    # Store waits on a round's members end as soon as the round is lost (see handler.py).
    # A weak reference: the store must not keep a dropped handler (and its keep-alive
    # timer, which torch ties to the handler's lifetime) alive.
    ref = weakref.WeakMethod(handler.round_lost)
    store.guard = lambda: (lambda m: m() if m is not None else None)(ref())


def _keyed_handler(params: RendezvousParameters, backend: Etcd3RendezvousBackend, store: Etcd3Store) -> Any:
    from resilient.rendezvous.keyed import KeyedRendezvousHandler, KeyedSettings

    settings = KeyedSettings(params.min_nodes, params.max_nodes)
    for name, key in (("join_timeout", "join_timeout"), ("last_call", "last_call_timeout"), ("poll", "poll_interval")):
        value = _seconds(params, key, None)
        if value is not None:
            setattr(settings, name, value)
    # Its keys live on a lease of torch's keep-alive window (keep_alive_interval ×
    # keep_alive_max_attempt, when torch's handler drops a silent node), not the store's
    # lease_ttl: a dead node's join key must go as fast, or a relaunched job waits behind
    # the dead job's round for a minute.
    attempts = params.get_as_int("keep_alive_max_attempt", RDZV_CONF["keep_alive_max_attempt"].default) or 3
    window = _seconds(params, "keep_alive_interval") * attempts  # type: ignore[operator]
    lease = LivenessLease(backend.client, window)
    handler = KeyedRendezvousHandler(params.run_id, backend.client, store, lease, backend.secret, settings,
                                     key_prefix=backend.key.rsplit("/", 2)[0], local_addr=params.local_addr)
    _guard_store(store, handler)
    return handler


def create_etcd3_handler(params: RendezvousParameters | None = None) -> Any:
    """Build a ``DynamicRendezvousHandler`` on etcd v3 for ``params``.

    Called with no argument (how torch 2.13 invokes a ``torchrun.handlers``
    entry point) it returns itself, the creator torch then registers.
    """
    if params is None:
        return create_etcd3_handler
    return _create_handler(params)


def _method_name(depth: int = 2) -> str:
    """What torch's ``dynamic_rendezvous.get_method_name`` answers (the name of the function
    ``depth`` frames up), without ``inspect.stack()``: see :func:`speed_up_event_records`."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def speed_up_event_records() -> None:
    """torch's rendezvous records an event at every state change, naming the calling method
    with ``inspect.stack()``, twice; that reads the source lines of every frame on the stack.
    Measured here (py-spy on an agent restarting after kill -9, load ~15): 0.8 s of a 1.1 s
    rendezvous round. The same name from ``sys._getframe`` costs microseconds."""
    if getattr(dynamic_rendezvous, "get_method_name", None) is not None:
        dynamic_rendezvous.get_method_name = _method_name


def register() -> None:
    """Register ``etcd3`` in torch's rendezvous handler registry (idempotent), and make its
    event records cheap (:func:`speed_up_event_records`)."""
    speed_up_event_records()
    try:
        # torch accepts re-registering the same creator (the entry point may have done it).
        rendezvous_handler_registry.register(BACKEND_NAME, create_etcd3_handler)
    except ValueError as exc:
        raise RendezvousConfigError(
            f"another rendezvous backend is already registered as {BACKEND_NAME!r} ({exc}); "
            "uninstall the package that provides it"
        ) from exc
