"""Shared fixtures. Fixtures of one subsystem live in its own test files."""

from __future__ import annotations

import pytest

from launchutil import CORPUS_TEXT_BYTES


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small byte-level corpus built from the Python standard library."""
    from resilient.data import prepare

    return prepare("python-stdlib", tmp_path_factory.mktemp("corpus"), max_bytes=CORPUS_TEXT_BYTES)


@pytest.fixture(scope="module")
def etcd():
    """A real etcd server for the tests of one module (skips if no binary)."""
    from resilient.etcd.testing import embedded_etcd

    with embedded_etcd() as server:
        yield server
