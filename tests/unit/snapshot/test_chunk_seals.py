"""ChunkSeals: each chunk's CRC and MAC computed once per capture, whichever writer (the node
store's, the durable tier's) reaches it first; another writer of the same chunk waits for that
result, and computes it itself if the first one failed."""

from __future__ import annotations

import threading
import time

import pytest

from resilient.snapshot.capture import ChunkSeals


def test_two_writers_of_one_chunk_compute_it_once_and_both_get_it():
    seals, calls, started = ChunkSeals(), [], threading.Event()

    def compute():
        calls.append(threading.current_thread().name)
        started.set()
        time.sleep(0.2)   # the other writer arrives meanwhile and waits
        return (123, "gmac:x")

    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", seals.get((0, ""), compute)), name="first")
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=lambda: got.setdefault("second", seals.get((0, ""), compute)), name="second")
    second.start()
    first.join(30), second.join(30)
    assert got == {"first": (123, "gmac:x"), "second": (123, "gmac:x")}
    assert calls == ["first"]
    assert seals.get((0, ""), compute) == (123, "gmac:x") and calls == ["first"]   # done: not again
    assert seals.get((1, ""), lambda: (7, "")) == (7, "")   # another chunk: its own


def test_a_writer_whose_compute_fails_leaves_the_chunk_to_the_next():
    seals, started, release = ChunkSeals(), threading.Event(), threading.Event()

    def failing():
        started.set()
        release.wait(30)
        raise OSError("the writer's store went away")

    errors = []

    def first():
        try:
            seals.get("c", failing)
        except OSError as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(30)
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("v", seals.get("c", lambda: (1, "m"))))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()   # waiting for the first writer's result
    release.set()
    t.join(30), waiter.join(30)
    assert len(errors) == 1 and got == {"v": (1, "m")}
    with pytest.raises(ZeroDivisionError):
        seals.get("d", lambda: 1 / 0)
    assert seals.get("d", lambda: (2, "n")) == (2, "n")
