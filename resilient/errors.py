"""The root of resilient's typed errors.

Every error a user can meet derives from :class:`ResilientError` and says what
to do about it. Subpackages define their own subclasses in their ``api.py``
(``RendezvousError``, ``SnapshotCorrupt``, ...); this module holds the root and
the errors shared by the whole runtime.
"""

from __future__ import annotations


class ResilientError(Exception):
    """Base of every error raised on purpose by resilient.

    The message names what went wrong, where (a file, a key, an object), and
    the fix. Catch this to tell resilient's own verdicts from bugs.
    """


class ConfigError(ResilientError, ValueError):
    """A run config is malformed: unknown key, wrong type, impossible layout."""


class DataError(ResilientError):
    """A corpus is missing, malformed, or does not fit the model."""


class LaunchError(ResilientError):
    """The job could not be started or ended in failure."""
