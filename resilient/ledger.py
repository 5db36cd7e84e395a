"""The run's ledger: records that outlive etcd and never go back.

Why: a MAC (:mod:`resilient.secret`) proves a record was written by a holder of the job
secret, not that it is the *newest* one. A writer of etcd who saved a genuine record could
put it back after it was superseded: a quarantine an operator cleared came back, and a
commit record deleted at a rollback could be restored from. And what lives only in etcd
dies with it: on one machine the embedded etcd goes with the job, and a node quarantined
for a bad device was trained on again by a plain relaunch.

So the records that must neither go back nor be forgotten (a node's quarantine, the run's
rollback epoch: :mod:`resilient.snapshot.epoch`) are kept in several *copies*: etcd (the
live one every node sees), the run dir (``RUN_DIR/ledger/<run>/...``, 0600 files in a 0700
dir: :mod:`resilient.rundir`) and the durable tier (``<durable url>/ledger/<run>/...``,
which every node of a fleet reaches). Each copy holds the same sealed record, its MAC bound
to the record's etcd key, so a copy cannot be moved to another key or run. Every record
carries ``gen``, a generation: each write takes one more than the highest generation found
in any copy it reads, and writes every copy it reaches. A reader takes every copy that
authenticates, and the highest generation wins (ties: the record's own order, a quarantine
over a clear: the safe side). Nothing is deleted: clearing a quarantine is a newer record
saying ``cleared``.

The monotonic truth is therefore the highest generation over the copies, and it holds
against whoever cannot write *every* copy: a writer of etcd without the job secret, the
run dir or the durable tier can delete or put back etcd's copy, and the run dir's or the
durable tier's newer copy still wins. Where etcd is the only copy (a fleet's node asked
without its run dir and without a durable tier), an etcd writer can still roll it back;
``resilient quarantine clear`` says so when that is all it reached.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from resilient.rundir import local_path, open_private, private_dir, write_private
from resilient.secret import JobSecret, Unauthentic, report_unauthentic

log = logging.getLogger(__name__)

__all__ = ["Copy", "EtcdCopy", "DirCopy", "UrlCopy", "run_copies", "Ledger", "gen_of", "newest", "LEDGER_DIR"]

LEDGER_DIR = "ledger"   # under the run dir and under the durable tier's root
_ROOT = "/resilient/"   # every ledger key lives under it (its etcd key)


def gen_of(doc: Mapping[str, Any]) -> int:
    """A record's generation (0 for a record from before generations)."""
    g = doc.get("gen", 0)
    return g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0


def newest(docs: Iterable[Mapping[str, Any]], order: Callable[[Mapping[str, Any]], int] = lambda d: 0):
    """The record with the highest ``(generation, order)``, or None: pure, the rule every reader applies."""
    return max(docs, key=lambda d: (gen_of(d), order(d)), default=None)


# ------------------------------------------------------------------ copies
class Copy:
    """One place a ledger record is kept: ``get``/``put`` a key's raw record, ``items`` under a prefix."""

    where = "?"

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def put(self, key: str, value: str) -> None:
        raise NotImplementedError

    def items(self, prefix: str) -> dict[str, bytes]:
        raise NotImplementedError


class EtcdCopy(Copy):
    where = "etcd"

    def __init__(self, client: Any):
        self.client = client

    def get(self, key: str) -> bytes | None:
        kv = self.client.get(key)
        return None if kv is None else kv.value

    def put(self, key: str, value: str) -> None:
        self.client.put(key, value)

    def items(self, prefix: str) -> dict[str, bytes]:
        return {kv.key.decode(errors="replace"): kv.value for kv in self.client.get_prefix(prefix)}


def _relative(key: str) -> str:
    """The file path of a ledger key under a copy's root. Keys are made of run and node ids,
    which launch checks (letters, digits, ``._-``, no ``..``); anything else is refused here
    too, so a key never names a path outside the copy."""
    parts = key.removeprefix(_ROOT).split("/")
    if not key.startswith(_ROOT) or any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise ValueError(f"not a ledger key: {key!r}")
    return "/".join(parts)


class DirCopy(Copy):
    """A directory on this machine (the run dir's ledger): private, written by rename."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.where = f"run dir {self.root}"

    def get(self, key: str) -> bytes | None:
        try:
            fd = open_private(self.root / _relative(key), os.O_RDONLY, what="ledger record")
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(1 << 20)

    def put(self, key: str, value: str) -> None:
        path = self.root / _relative(key)
        private_dir(self.root, "ledger", narrow=True)
        for parent in reversed(path.relative_to(self.root).parents[:-1]):
            private_dir(self.root / parent, "ledger", narrow=True)
        write_private(path, value, fsync=True)

    def items(self, prefix: str) -> dict[str, bytes]:
        base = self.root / _relative(prefix + "x").removesuffix("x")
        if not base.is_dir():
            return {}
        out = {}
        for path in sorted(base.iterdir()):
            if path.name.startswith(".") or not path.is_file():
                continue   # a write in flight (.<name>.<pid>.tmp)
            got = self.get(prefix + path.name)
            if got is not None:
                out[prefix + path.name] = got
        return out


class UrlCopy(Copy):
    """A copy on the durable tier's storage (fsspec: ``s3://``, ``gs://``...): an object per key,
    each written at once (an object store's PUT is atomic)."""

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        self.where = f"durable tier {self.url}"
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{LEDGER_DIR}/{_relative(key)}"

    def get(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return None

    def put(self, key: str, value: str) -> None:
        self.fs.pipe_file(self._path(key), value.encode())

    def items(self, prefix: str) -> dict[str, bytes]:
        base = self._path(prefix + "x").removesuffix("x")
        try:
            names = self.fs.ls(base.rstrip("/"), detail=False)
        except FileNotFoundError:
            return {}
        out = {}
        for name in names:
            key = prefix + name.rstrip("/").rsplit("/", 1)[-1]
            got = self.get(key)
            if got is not None:
                out[key] = got
        return out


def run_copies(run_dir: str | os.PathLike | None, durable_url: str = "") -> list[Copy]:
    """Where a relaunch finds the ledger besides etcd: the run dir's (``RUN_DIR/ledger``) and the
    durable tier's (``durable_url``; none when it lies in the run dir, its default). A local
    durable tier's is a private directory, a remote one's objects."""
    copies: list[Copy] = []
    if run_dir is not None:
        copies.append(DirCopy(Path(run_dir) / LEDGER_DIR))
    if not durable_url:   # the default, RUN_DIR/checkpoints: the run dir's copy says it all
        return copies
    local = local_path(durable_url)
    if local is not None:
        if run_dir is None or not local.is_relative_to(Path(run_dir).resolve()):   # else the same disk, twice
            copies.append(DirCopy(local / LEDGER_DIR))
    else:
        try:
            copies.append(UrlCopy(durable_url))
        except Exception as e:  # no fsspec backend for it here: the other copies still hold
            log.warning("the ledger's copy on the durable tier %s cannot be used (%s)", durable_url, e)
    return copies


# ------------------------------------------------------------------ the ledger
class Ledger:
    """Sealed, generation-numbered records of one ``purpose`` across ``copies`` (module docstring).

    ``order(doc)`` breaks a tie of generations (the higher wins). ``secret`` is resolved when
    first needed (a callable). ``what`` names the records in ``auth_failure`` reports."""

    def __init__(self, purpose: str, secret: Callable[[], JobSecret], copies: Iterable[Copy], events: Any = None,
                 what: str = "record", order: Callable[[Mapping[str, Any]], int] = lambda d: 0):
        self.purpose, self._secret, self.copies = purpose, secret, list(copies)
        self.events, self.what, self.order = events, what, order
        self.errors: dict[str, str] = {}   # copy -> why its last read or write failed

    def _open(self, key: str, raw: bytes, copy: Copy, forged: dict[str, str]) -> dict | None:
        try:
            return self._secret().open_record(self.purpose, key, raw)
        except Unauthentic as e:
            report_unauthentic(self.events, self.what, key if copy.where == "etcd" else f"{copy.where}:{key}", e)
            forged.setdefault(key, f"{copy.where}: {e}")
            return None

    def _each(self, read: Callable[[Copy], Any], strict: Copy | None) -> list[tuple[Copy, Any]]:
        """``read(copy)`` of every copy; a copy that fails is left out (and noted in ``errors``),
        but for ``strict`` (etcd at a node's start: unreachable must stop the start)."""
        out = []
        for copy in self.copies:
            try:
                out.append((copy, read(copy)))
            except Exception as e:
                if copy is strict:
                    raise
                self.errors[copy.where] = f"{type(e).__name__}: {e}"
                log.warning("could not read the %s copy of %s records: %s", copy.where, self.what, e)
        return out

    def read(self, key: str, strict: Copy | None = None) -> tuple[dict | None, dict[str, str]]:
        """(the newest authentic record at ``key`` over every copy or None, {key: why} of copies
        that fail authentication)."""
        forged: dict[str, str] = {}
        docs = [d for copy, raw in self._each(lambda c: c.get(key), strict) if raw is not None
                for d in [self._open(key, raw, copy, forged)] if d is not None]
        return newest(docs, self.order), forged

    def scan(self, prefix: str, strict: Copy | None = None) -> tuple[dict[str, dict], dict[str, str]]:
        """({suffix: the newest authentic record}, {suffix: why a copy fails}) under ``prefix``."""
        found: dict[str, list[dict]] = {}
        forged: dict[str, str] = {}
        for copy, items in self._each(lambda c: c.items(prefix), strict):
            for key, raw in items.items():
                doc = self._open(key, raw, copy, forged)
                if doc is not None:
                    found.setdefault(key, []).append(doc)
        return ({k.removeprefix(prefix): newest(v, self.order) for k, v in found.items()},
                {k.removeprefix(prefix): why for k, why in forged.items() if k not in found})

    def write(self, key: str, doc: Mapping[str, Any], strict: Copy | None = None) -> list[str]:
        """Seal ``doc`` with the next generation (one above every copy's) and write it to every
        copy; the copies written (their ``where``). Raises the last error when none took it."""
        current, _ = self.read(key, strict)
        body = {k: v for k, v in doc.items() if k not in ("gen", "mac")}
        raw = self._secret().seal_record(self.purpose, key, {**body, "gen": gen_of(current or {}) + 1})
        written, last = [], None
        for copy in self.copies:
            try:
                copy.put(key, raw)
                written.append(copy.where)
            except Exception as e:
                if copy is strict:
                    raise
                last = e
                self.errors[copy.where] = f"{type(e).__name__}: {e}"
                log.warning("could not write the %s copy of %s %s: %s", copy.where, self.what, key, e)
        if not written and last is not None:
            raise last
        return written
