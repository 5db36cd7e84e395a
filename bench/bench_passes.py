"""passes: one version's path, pass by pass, in CPU per byte against a memory copy (issue 43).

Why this row: at real sizes (tens of GB per node and version) the CPU each byte costs on
its way from the tensors to a peer's RAM decides whether a snapshot every step is
affordable. The floor on a host without RDMA is the bytes moved: one capture copy, the
kernel's copy out and in, a checksum and a MAC pass, each at several GB/s. This row puts
the path we run beside those passes, on the same bytes, in one run:

- the floors, alone on one buffer of the rank's size: a ``copy_`` into a reused buffer
  (the unit: "copies"), CRC-32C, AES-GMAC (the chunk and channel MACs), a write into a
  new ``/dev/shm`` file (a node store's new file) and into an existing one (a spare file reused), and a loopback TCP transfer (``sendfile`` out of
  a ``/dev/shm`` file, ``recv_into`` a reused buffer: both ends);
- the real path (``bench/push_cost.py``'s measurement: a real Snapshotter writing a real
  node store, the agent's own push code to a real PeerServer over loopback): the
  training thread's **capture** (until ``save`` returns), the **writer** (CRCs, chunk MACs,
  the store's files, on its threads), the **push** (both ends: channel MACs, the
  receiver's CRC check, its file).

Every figure is process CPU (all threads) per MB, median over the repeats; the trials
alternate, so load hits them alike. "copies" = a pass's CPU per byte / the copy's.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time

from common import alternate, fig, goal, row

MB = 1 << 20
GOAL_COPIES = 4.0   # issue 43: capture + push, both ends, within 4 copies' worth of CPU per byte


def _floors(nbytes: int, repeats: int) -> dict[str, list[float]]:
    """CPU seconds per trial of each floor pass over ``nbytes``."""
    import torch
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from resilient.snapshot.format import crc

    torch.set_num_threads(1)   # as the push_cost measurement: one thread's CPU, no idle spinning
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.zero_()   # faulted in, as a reused slot is
    raw = memoryview(src.numpy()).cast("B")
    gmac = AESGCM(os.urandom(16))
    folder = tempfile.mkdtemp(prefix="passes-", dir="/dev/shm")
    source = os.path.join(folder, "source")
    with open(source, "wb") as f:
        f.write(raw)
    inbox = bytearray(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(listener.getsockname())
    inn, _ = listener.accept()
    ready, done, received = threading.Event(), threading.Event(), threading.Event()

    def receive() -> None:
        view = memoryview(inbox)
        while True:
            ready.wait()
            ready.clear()
            if done.is_set():
                return
            got = 0
            while got < nbytes:
                n = inn.recv_into(view[got:], nbytes - got)
                if not n:
                    return
                got += n
            received.set()

    t = threading.Thread(target=receive, daemon=True)
    t.start()

    def cpu(fn) -> float:
        c0 = time.process_time()
        fn()
        return time.process_time() - c0

    def write() -> None:
        fd = os.open(os.path.join(folder, "written"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, raw)   # /dev/shm takes it in one call
        finally:
            os.close(fd)
        os.unlink(os.path.join(folder, "written"))

    def rewrite() -> None:
        fd = os.open(source, os.O_WRONLY)
        try:
            os.pwrite(fd, raw, 0)   # its pages are there already: a spare file reused
        finally:
            os.close(fd)

    def loopback() -> None:
        received.clear()
        ready.set()
        with open(source, "rb") as f:
            out.sendfile(f)
        received.wait()

    try:
        return alternate({
            "copy": lambda: cpu(lambda: dst.copy_(src)),
            "crc32c": lambda: cpu(lambda: crc(raw)),
            "gmac": lambda: cpu(lambda: gmac.encrypt(os.urandom(12), b"", raw)),
            "write": lambda: cpu(write),
            "rewrite": lambda: cpu(rewrite),
            "loopback": lambda: cpu(loopback),
        }, repeats)
    finally:
        done.set()
        ready.set()
        out.close(), inn.close(), listener.close()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def run(quick: bool = False) -> dict:
    from push_cost import measure

    sizes = [(7, 4 if quick else 20), (32 if quick else 256, 3 if quick else 6)]
    figures, ratios, goals, notes = {}, {}, [], []
    for mb, reps in sizes:
        nbytes = int(mb * MB)
        floors = _floors(nbytes, reps)
        real = measure(mb, reps)
        per_mb = nbytes / MB
        ms_per_mb = lambda secs: [s * 1e3 / per_mb for s in secs]  # noqa: E731
        for name, secs in floors.items():
            figures[f"{mb}MB_{name}"] = fig(ms_per_mb(secs), "CPU ms per MB", f"{name} ({mb} MB)")
        capture = real["capture_cpu_ms_all"]
        writer = [w - c for w, c in zip(real["write_cpu_ms_all"], capture)]
        push = real["cpu_ms_all"]
        for name, ms in (("capture", capture), ("writer", writer), ("push", push)):
            figures[f"{mb}MB_{name}"] = fig([m / per_mb for m in ms], "CPU ms per MB", f"{name} ({mb} MB)")
        unit = figures[f"{mb}MB_copy"]["median"]
        path = sum(figures[f"{mb}MB_{p}"]["median"] for p in ("capture", "writer", "push"))
        copies = round(path / unit, 2) if unit else None
        ratios[f"path_{mb}MB"] = {"value": copies, "better": "lower",
                                  "label": f"the whole path (capture + writer + push, both ends) / one copy, per byte, {mb} MB rank"}
        for p in ("capture", "writer", "push", "crc32c", "gmac", "write", "rewrite", "loopback"):
            ratios[f"{p}_{mb}MB"] = {"value": round(figures[f"{mb}MB_{p}"]["median"] / unit, 2) if unit else None,
                                     "better": "lower", "label": f"{p} / one copy, per byte, {mb} MB rank"}
        floor = sum(figures[f"{mb}MB_{p}"]["median"] for p in ("copy", "crc32c", "gmac", "loopback")) / unit if unit else None
        goals.append(goal(f"the whole path within {GOAL_COPIES:g} copies' worth of CPU per byte ({mb} MB rank; issue 43)",
                          None if quick or copies is None else copies <= GOAL_COPIES,
                          f"{copies} copies (capture {ratios[f'capture_{mb}MB']['value']}, writer "
                          f"{ratios[f'writer_{mb}MB']['value']}, push {ratios[f'push_{mb}MB']['value']}); the floor "
                          f"passes it needs (a copy, a CRC, a MAC, the kernel's copy out and in) add up to "
                          f"{floor:.2f}" if floor is not None else "no copy measured"))
        notes.append(f"{mb} MB rank: copy {unit:.3f} CPU ms/MB ({1 / unit:.1f} GB/s of CPU); " if unit else f"{mb} MB: ")
        notes[-1] += (f"push wall {real['wall_ms']} ms for {real['bytes']} bytes; repeats {reps}; the real path by "
                      f"`bench/push_cost.py --mb {mb}` (one process holds both ends of the push)")
    notes.append("Where the real path spends beyond the floor: the writer writes each chunk into the node store "
                 "from the capture's slot (a second copy after the capture's), and checks it with a CRC and a MAC; "
                 "the push MACs each piece on both ends (the channel's tags) and the receiver CRCs it again.")
    return row("The snapshot path pass by pass: CPU per byte against a memory copy",
               figures, ratios, goals, notes)


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=True), indent=1)[:4000])
