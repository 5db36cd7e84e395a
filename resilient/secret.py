"""The job secret, and the MACs that make etcd and the peer channel untrusted carriers.

Why: the etcd prefix is not the trust boundary (anyone who can write it, on a
shared host every local user of an unauthenticated embedded etcd, would
otherwise run code in every agent through torch's pickled rendezvous state,
pick the version a job restores, or clear a quarantine). Every record read
back from etcd and every peer payload is authenticated with a per-job secret
that never travels through etcd.

Where the secret comes from (first found):

1. a file named by ``--secret-file`` (``launch``, ``quarantine``) or by the
   rendezvous config key ``secret_file``;
2. a file named by ``$RESILIENT_JOB_SECRET_FILE`` (a Kubernetes Secret volume,
   a file Slurm's ``sbcast`` distributed);
3. the value of ``$RESILIENT_JOB_SECRET``;
4. single-machine default (``resilient launch`` only): ``RUN_DIR/job.secret``,
   created with mode 0600 by the first agent (atomically: written aside, then
   linked into place), read by the others on the same run dir. Only in a run
   dir of this user's own (:mod:`resilient.rundir`), never through a link, and
   only if this user owns the file: a run dir another user made first, with a
   secret of theirs in it, is refused, never adopted.

A secret file that other users can read (or that its group can write), or that
belongs to another user than this one or root, is refused. The secret is text of at least 32 characters (``secrets.token_hex(32)``
makes one); its bytes are the key material. Each use derives its own key
(HMAC-SHA256 of a purpose label), and every MAC covers the etcd key a record
lives under, so a record cannot be moved to another key, run or purpose.

Records: a JSON record gets a ``"mac"`` field over its canonical JSON (sorted
keys, no spaces) and its etcd key; readers that only display records keep
parsing them. Blobs (torch's pickled rendezvous state) are sealed as
``MAGIC + tag + payload``. What fails is :class:`Unauthentic`, reported once a
minute per key (log warning and an ``auth_failure`` event) and never used.

Replay. A MAC says who wrote a record, not that it is still current: a writer
of etcd who saved a genuine record can put it back after it was superseded. So
the records whose going back would matter are bound to what supersedes them,
and the highest counter, not etcd's copy, is the truth:

- a node's quarantine (:mod:`resilient.agent.quarantine`) carries a generation
  ``gen``; a clear is not a delete but a newer record saying ``cleared``. The
  records live in the run's ledger (:mod:`resilient.ledger`): etcd, the run dir
  (``RUN_DIR/ledger``, private) and the durable tier, each write one generation
  above the highest of every copy it reads, each reader taking the highest
  generation of every copy that authenticates. A cleared quarantine put back
  in etcd is older than the clear in the run dir: it stays cleared; a
  quarantine deleted from etcd is still in the others: it stays quarantined.
- commit records carry the run's *epoch* (its incarnation: the count of its
  rollbacks, :mod:`resilient.snapshot.epoch`); a rollback raises the epoch, in
  the ledger, and records the step it kept. A commit of a later step made in an
  earlier epoch is abandoned, refused by every reader, put back or not; the
  committers fence their commits on the epoch, so none races a rollback.

Where the monotonic truth lives, and against whom it holds: in the highest
counter over the ledger's copies. Someone who can write etcd but has neither
the secret nor the run dir nor the durable tier can delete, put back or forge
etcd's copy and changes nothing a reader with another copy believes (a forgery
fails its MAC; a replay is older than the copy in the run dir or the durable
tier). Whoever also writes the durable tier can roll back its copy too: the run
dir's still wins on its machine. With etcd as the only copy (a reader on a
machine without the run dir, a job without a durable tier it can reach), an
etcd writer can roll records back: a cleared quarantine comes back (a node
refused), an abandoned commit record is believed again (a restore may load the
abandoned future from node RAM, if its holders still keep it); so give a fleet a
durable tier every node reaches, and ``resilient quarantine clear`` warns when
etcd was all it reached.
What nobody without the secret can do is write a record any reader accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from resilient.contract import SECRET_ENV, SECRET_FILE_ENV
from resilient.errors import ResilientError

log = logging.getLogger(__name__)

__all__ = ["SECRET_ENV", "SECRET_FILE_ENV", "RUN_DIR_SECRET", "JobSecret", "JobSecretError", "Unauthentic",
           "resolve_secret", "require_secret", "provide_job_secret", "read_records", "report_unauthentic"]

RUN_DIR_SECRET = "job.secret"
MIN_LENGTH = 32
MAGIC = b"rsec1\x00"   # version tag of a sealed blob: a new scheme gets a new tag
TAG = 32               # bytes of an HMAC-SHA256 tag
# Purposes: each gets its own derived key, so a MAC made for one never passes as another.
RDZV_STATE, REGISTRY, HOLDS, COMMIT, QUARANTINE, PEER = (
    "rdzv-state", "registry", "holds", "commit", "quarantine", "peer")
ETCD_ROOT = "etcd-root"  # the embedded etcd's root password (JobSecret.etcd_password)
_HOW = ("give every node of the job the same secret: a file (mode 0600) named by --secret-file or "
        f"${SECRET_FILE_ENV}, or the value of ${SECRET_ENV}; make one with "
        "`python -c 'import secrets; print(secrets.token_hex(32))'`")


class JobSecretError(ResilientError):
    """The job secret is missing, unreadable, too short, or in a file other users can read."""


class SecretMismatch(JobSecretError):
    """Another agent of this run holds a different job secret (its registry entry names another
    secret fingerprint): the two could never authenticate each other's records, and would
    only log ``auth_failure`` until a rendezvous timed out. Give every node the same secret."""


class Unauthentic(ResilientError):
    """A record or payload does not carry a valid MAC under this node's job secret: written by
    a process without the secret, tampered with, truncated, or from a job with another secret."""


class JobSecret:
    """Key material plus the keys derived from it, one per purpose."""

    def __init__(self, material: bytes, source: str = "given"):
        if len(material) < MIN_LENGTH:
            raise JobSecretError(f"the job secret from {source} has {len(material)} bytes, fewer than "
                                 f"{MIN_LENGTH}; {_HOW}")
        self.material, self.source = bytes(material), source
        self._keys: dict[str, bytes] = {}

    @classmethod
    def of(cls, secret: "JobSecret | bytes") -> "JobSecret":
        """Accept the raw material (what StoreInfo.secret() hands workers) or a JobSecret."""
        return secret if isinstance(secret, JobSecret) else cls(bytes(secret))

    def key(self, purpose: str) -> bytes:
        k = self._keys.get(purpose)
        if k is None:
            k = self._keys[purpose] = hmac.digest(self.material, b"resilient-v1/" + purpose.encode(), "sha256")
        return k

    @property
    def fingerprint(self) -> str:
        """A short, non-secret name of this secret, for messages: two nodes can compare theirs."""
        return self.key("fingerprint").hex()[:12]

    @property
    def etcd_password(self) -> str:
        """The password of the embedded etcd's ``root`` user (:mod:`resilient.etcd.server`). Derived,
        never stored: every holder of the secret derives the same one, and it tells nothing of the
        secret or of the other keys (a MAC of its own purpose label)."""
        return self.key(ETCD_ROOT).hex()

    def mac(self, purpose: str, *parts: bytes) -> bytes:
        """HMAC-SHA256 under the purpose's key over length-prefixed parts (no two part lists collide)."""
        h = hmac.new(self.key(purpose), digestmod=hashlib.sha256)
        for p in parts:
            h.update(struct.pack("!Q", len(p)))
            h.update(p)
        return h.digest()

    # -- blobs ------------------------------------------------------------------
    def seal(self, purpose: str, where: str, payload: bytes) -> bytes:
        return MAGIC + self.mac(purpose, where.encode(), payload) + payload

    def unseal(self, purpose: str, where: str, blob: bytes) -> bytes:
        blob = bytes(blob)
        if not blob.startswith(MAGIC):
            what = "empty" if not blob else "not sealed by resilient (no version tag)"
            raise Unauthentic(f"{where}: {what}")
        tag, payload = blob[len(MAGIC):len(MAGIC) + TAG], blob[len(MAGIC) + TAG:]
        if len(tag) < TAG or not hmac.compare_digest(tag, self.mac(purpose, where.encode(), payload)):
            raise Unauthentic(f"{where}: MAC mismatch (tampered, truncated, or sealed with another job secret "
                              f"than this node's, fingerprint {self.fingerprint})")
        return payload

    # -- JSON records -----------------------------------------------------------
    def seal_record(self, purpose: str, key: str, doc: Mapping[str, Any]) -> str:
        body = {k: v for k, v in doc.items() if k != "mac"}
        return json.dumps({**body, "mac": self._record_mac(purpose, key, body)})

    def open_record(self, purpose: str, key: str, raw: bytes | str) -> dict:
        """The record at ``key`` if its MAC verifies; :class:`Unauthentic` otherwise (also for non-JSON)."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise Unauthentic(f"{key}: not a JSON record") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("mac"), str):
            raise Unauthentic(f"{key}: the record carries no MAC")
        body = {k: v for k, v in doc.items() if k != "mac"}
        if not hmac.compare_digest(doc["mac"], self._record_mac(purpose, key, body)):
            raise Unauthentic(f"{key}: MAC mismatch (forged, tampered, or written with another job secret than "
                              f"this node's, fingerprint {self.fingerprint})")
        return body

    def _record_mac(self, purpose: str, key: str, body: Mapping[str, Any]) -> str:
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return self.mac(purpose, key.encode(), canon.encode()).hex()


# ------------------------------------------------------------------ where it comes from
def _read_file(path: str | os.PathLike, source: str, run_dir: bool = False) -> JobSecret:
    """``run_dir``: the run dir's own secret, which this user's agent made: never through a
    link, and only if this user owns it. A given file may be a link (a Kubernetes Secret
    volume's are) and may belong to root (which could forge anything anyway)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if run_dir else 0))
    except FileNotFoundError:
        raise JobSecretError(f"job secret file {path} (from {source}) does not exist; {_HOW}") from None
    except OSError as e:
        if run_dir and os.path.islink(path):
            raise JobSecretError(f"job secret file {path} (from {source}) is a symbolic link: whoever made it "
                                 f"chose the secret. Remove it if you did not make it; the next launch creates a "
                                 f"new one") from None
        raise JobSecretError(f"job secret file {path} (from {source}) cannot be read ({e.strerror}); {_HOW}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JobSecretError(f"job secret file {path} (from {source}) is not a regular file")
        if st.st_uid not in ((os.geteuid(),) if run_dir else (os.geteuid(), 0)):
            from resilient.rundir import owner_name

            raise JobSecretError(
                f"job secret file {path} (from {source}) is owned by {owner_name(st.st_uid)}, not by you: whoever "
                f"wrote it knows the secret and could forge every record of the job. Use a secret file of your own"
                + (f"; remove {path} if you know where it came from (the next launch creates a new one), or "
                   f"pass another --run-dir" if run_dir else ""))
        # Others may not read it; a group may (a Kubernetes Secret mounted with fsGroup is
        # 0440) but not write it (whoever can rewrite the secret can forge everything).
        if st.st_mode & 0o027:
            raise JobSecretError(
                f"job secret file {path} (from {source}) has mode {stat.S_IMODE(st.st_mode):04o}: other users can "
                f"{'read' if st.st_mode & 0o004 else 'write or use'} it, so it protects nothing. "
                f"`chmod 600 {path}` (on Kubernetes: defaultMode 0400 on the Secret volume)")
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
            if len(data) > 1 << 16:
                raise JobSecretError(f"job secret file {path} is larger than 64 KiB; is it the right file?")
    finally:
        os.close(fd)
    return JobSecret(data.strip(), f"{source} ({path})")


def resolve_secret(secret_file: str | os.PathLike | None = None,
                   env: Mapping[str, str] | None = None) -> JobSecret | None:
    """The job secret from ``secret_file``, ``$RESILIENT_JOB_SECRET_FILE`` or ``$RESILIENT_JOB_SECRET``
    (first given); None when none is."""
    env = os.environ if env is None else env
    if secret_file:
        return _read_file(secret_file, "--secret-file")
    if env.get(SECRET_FILE_ENV):
        return _read_file(env[SECRET_FILE_ENV], f"${SECRET_FILE_ENV}")
    if env.get(SECRET_ENV):
        return JobSecret(env[SECRET_ENV].strip().encode(), f"${SECRET_ENV}")
    return None


def require_secret(secret_file: str | os.PathLike | None = None, what: str = "this process") -> JobSecret:
    """:func:`resolve_secret`, or :class:`JobSecretError` saying how to provide one."""
    found = resolve_secret(secret_file)
    if found is None:
        raise JobSecretError(f"{what} needs the job secret and none is set; {_HOW}. (`resilient launch` creates "
                             f"one in the run dir, {RUN_DIR_SECRET}, when the nodes share it.)")
    return found


def run_dir_secret(run_dir: str | os.PathLike) -> Path:
    """``RUN_DIR/job.secret``, created (mode 0600) if absent. Concurrent first agents agree:
    each writes its own candidate aside and links it into place, so exactly one wins and a
    reader never sees a half-written file. The run dir must be this user's alone
    (:func:`resilient.rundir.private_dir`: a run dir another user made, with a secret of
    theirs in it, is refused, never adopted)."""
    from resilient.rundir import private_dir

    path = private_dir(run_dir) / RUN_DIR_SECRET
    if os.path.lexists(path):
        return path
    tmp = path.with_name(f".{RUN_DIR_SECRET}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another agent won: use its secret
    finally:
        os.unlink(tmp)
    return path


def provide_job_secret(run_dir: str | os.PathLike, secret_file: str | os.PathLike | None = None) -> JobSecret:
    """For ``resilient launch``: the secret given (file or environment), else the run dir's
    (created if absent). The file's path is put in ``$RESILIENT_JOB_SECRET_FILE`` so the
    rendezvous, registry and quarantine of this process find it, and so do the workers."""
    given = resolve_secret(secret_file)
    if given is not None:
        if secret_file:
            os.environ[SECRET_FILE_ENV] = str(Path(secret_file).resolve())
        return given
    path = run_dir_secret(run_dir)
    found = _read_file(path, "the run dir", run_dir=True)
    os.environ[SECRET_FILE_ENV] = str(path.resolve())
    return found


def read_records(client: Any, prefix: str, purpose: str, secret: JobSecret | bytes, events: Any = None,
                 what: str = "record") -> dict[str, dict]:
    """Every record under ``prefix`` that authenticates, by key suffix; the others are reported
    (:func:`report_unauthentic`) and left out. Raises what the client raises (etcd down)."""
    secret = JobSecret.of(secret)
    out = {}
    for kv in client.get_prefix(prefix):
        key = kv.key.decode(errors="replace")
        try:
            out[key.removeprefix(prefix)] = secret.open_record(purpose, key, kv.value)
        except Unauthentic as e:
            report_unauthentic(events, what, key, e)
    return out


# ------------------------------------------------------------------ reporting
_reported: dict[tuple[str, str], float] = {}
_reported_lock = threading.Lock()
REPORT_EVERY = 60.0


def report_unauthentic(events: Any, what: str, key: str, error: BaseException | str) -> None:
    """A record that failed authentication: a warning and an ``auth_failure`` event, at most once a
    minute per (what, key) (a forged record is read at every poll)."""
    now = time.monotonic()
    with _reported_lock:
        if now - _reported.get((what, key), -REPORT_EVERY) < REPORT_EVERY:
            return
        _reported[(what, key)] = now
        if len(_reported) > 4096:
            _reported.clear()
    log.warning("ignored an unauthentic %s at %s: %s", what, key, error)
    if events is not None:
        try:
            events.emit("auth_failure", what=what, key=key, error=str(error))
        except Exception as e:  # reporting must never break the reader
            log.debug("could not emit auth_failure: %s", e)
