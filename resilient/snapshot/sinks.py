"""Where a rank's snapshot writer puts a version's objects: one interface, two sinks.

The same writer (:class:`~resilient.snapshot.durable.Uploader`) streams a captured
version to the durable tier (any fsspec URL) and to the agent's node store (the local
RAM tier, a tmpfs directory). What differs is where the bytes go and what happens around
them, and it lives here, not in the writer:

* :class:`ObjectSink` (a storage URL): each object written whole or not at all
  (:func:`~resilient.snapshot.storage.write_object`); nothing to tell anyone.
* :class:`NodeStoreSink` (a directory holding an agent's owner file): data files rewrite
  the store's retired files in place through a mapping (tmpfs ``write`` is ~7x its cost),
  version directories are private (0700), the agent's doorbell rings when a version
  landed, and a full store is reported to the agent (its own fix, once a minute) instead
  of warned of on every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from resilient.snapshot.nodestore import BELL, SPARES, Doorbell, Spares
from resilient.snapshot.storage import is_remote, node_store_path, write_object
from resilient.snapshot.storefull import out_of_space, report_store_full

__all__ = ["ObjectSink", "NodeStoreSink", "open_sink"]


class ObjectSink:
    """A storage URL's filesystem ``fs``: the durable tier."""

    def __init__(self, fs: Any):
        self.fs = fs
        self.remote = is_remote(fs)  # compressing 16-bit floats pays only over a slow link

    def write(self, path: str, pieces: Iterable[Any], size: int | Any) -> None:
        """A data object: the concatenation of ``pieces`` (``size``: an int, or a callable for
        pieces produced while writing), whole or absent."""
        write_object(self.fs, path, pieces, size)

    def write_manifest(self, path: str, doc: bytes) -> None:
        write_object(self.fs, path, [doc], len(doc))

    def landed(self) -> None:
        """A rank's part of a version is all written (its rank manifest last)."""

    def failed(self, step: int, error: BaseException) -> bool:
        """Whether this sink reported the failed write of ``step`` itself (else the writer warns)."""
        return False


class NodeStoreSink(ObjectSink):
    """An agent's node store at ``store`` (see the module docstring)."""

    def __init__(self, fs: Any, store: Path):
        super().__init__(fs)
        self.store = store
        self.spares = Spares(store / SPARES)
        self.bell = store / BELL

    def write(self, path: str, pieces: Iterable[Any], size: int | Any) -> None:
        write_object(self.fs, path, pieces, size, self.spares)

    def write_manifest(self, path: str, doc: bytes) -> None:
        write_object(self.fs, path, [doc], len(doc), in_store=True)

    def landed(self) -> None:
        Doorbell.ring(self.bell)

    def failed(self, step: int, error: BaseException) -> bool:
        if not out_of_space(error):
            return False
        report_store_full(self.store, step)
        return True


def open_sink(fs: Any, root: str) -> ObjectSink:
    """The sink for a writer's ``root`` on ``fs``: the node store's when ``root`` is one."""
    store = node_store_path(fs, root)
    return NodeStoreSink(fs, store) if store is not None else ObjectSink(fs)
