"""Reaching a run's etcd and records from outside the job: an operator's command
(``resilient quarantine``, ``resilient status``) given a run dir, an endpoint, a secret.

Why its own module: a command runs in no agent and no worker, yet must reach the job's etcd
exactly as ``launch`` does (TLS, login, the embedded etcd's certificate and password derived
from the job secret) and find the run's copies of its records; both commands need it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from resilient.etcd import EtcdAuthError, EtcdClient, EtcdError, EtcdUnavailable
from resilient.secret import RUN_DIR_SECRET, JobSecret, require_secret, resolve_secret

__all__ = ["durable_url_of", "cli_secret", "cli_client"]


def durable_url_of(run_dir: str | os.PathLike | None) -> str:
    """The durable tier's URL of the run in ``run_dir`` (its ``runtime.json``, as launch wrote
    it); "" for the default (``RUN_DIR/checkpoints``) or when the file says nothing."""
    if run_dir is None:
        return ""
    try:
        doc = json.loads((Path(run_dir) / "runtime.json").read_text())
        url = doc.get("snapshot", {}).get("durable_url", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return url if isinstance(url, str) else ""


def cli_secret(args: argparse.Namespace, what: str = "`resilient quarantine`") -> JobSecret:
    """The job secret a command was given: ``--secret-file``, the environment, else the run dir's."""
    found = resolve_secret(args.secret_file)
    if found is None and args.run_dir:
        found = resolve_secret(Path(args.run_dir) / RUN_DIR_SECRET)
    return found if found is not None else require_secret(what=what)


def cli_client(args: argparse.Namespace, secret: JobSecret | None) -> EtcdClient:
    """An etcd client reaching the job's etcd as ``launch`` does (TLS, user and password), checked.

    ``args.embedded`` (the endpoint is a run dir's embedded etcd): with the client certificate and
    login derived from the job secret (:func:`resilient.etcd.server.embedded_etcd_conf`). Else,
    without a user in ``--rdzv-conf``, an etcd that demands a login or TLS is taken for the embedded
    etcd of ``resilient launch`` (no other etcd trusts that certificate or takes that password; a
    wrong or missing secret is a clear error)."""
    from resilient.etcd.server import embedded_etcd_conf
    from resilient.rendezvous.registry import etcd_client, parse_rdzv_conf

    conf = {"retry_timeout": 5.0, **parse_rdzv_conf(args.rdzv_conf)}

    def connect(conf: dict) -> EtcdClient:
        client = etcd_client(args.rdzv_endpoint, conf, args.run_id)
        try:
            client.check()  # a wrong endpoint: a clear error in seconds, not the client's long retries
            client.count_prefix(f"/resilient/{args.run_id}/quarantine/")  # a login, if etcd wants one
        except BaseException:
            client.close()
            raise
        return client

    if conf.get("username") or conf.get("user"):
        return connect(conf)
    if not getattr(args, "embedded", False):
        try:
            return connect(conf)
        except EtcdUnavailable:
            raise
        except EtcdError:
            pass  # a login or a client certificate wanted: the embedded etcd, with the job secret's
    secret = secret if secret is not None else cli_secret(args)
    try:
        return connect({**conf, **embedded_etcd_conf(secret)})
    except EtcdAuthError as e:
        raise EtcdAuthError(
            f"etcd at {args.rdzv_endpoint} wants a login: if it is the embedded etcd of `resilient launch`, it "
            f"refused this job secret (fingerprint {secret.fingerprint}): pass the run's (--run-dir or "
            f"--secret-file); if it is an external etcd, pass --rdzv-conf username=... and "
            f"RESILIENT_ETCD_PASSWORD. ({e})") from None
