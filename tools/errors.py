"""Typed errors of the checkpoint tools (snapshot errors are reused where they fit).

A wrong URL, a missing version, a corrupted manifest and a newer format come
from :mod:`resilient.snapshot.api` (``NoSnapshotFound``, ``SnapshotCorrupt``,
``FormatVersionError``); what only the tools can get wrong is here.
"""

from __future__ import annotations

from resilient.errors import ResilientError


class CkptToolError(ResilientError):
    """Base of the checkpoint tools' own errors."""


class BadUrl(CkptToolError):
    """The URL does not exist or is not a checkpoint directory; check the path (and credentials)."""


class LayoutError(CkptToolError):
    """The target layout cannot hold this model (e.g. tp does not divide the heads); pick another."""


class OutputExists(CkptToolError):
    """The output already holds what would be written; choose another OUT or remove it first."""


class ConvertError(CkptToolError):
    """A conversion cannot be done (unsupported dtype, unreadable source, name clash)."""


class UnsafeCheckpoint(ConvertError):
    """A checkpoint's pickle names a global outside the allow-list (a crafted file runs code that way); it is
    never unpickled. Re-save the checkpoint from its source, or import a format that is not a pickle."""
