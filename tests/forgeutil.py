"""Forging a CRC-32C, as an attacker does (tests only): a CRC is affine in the message's
bits, so four free bytes make any data match any CRC. What a chunk MAC exists for."""

from __future__ import annotations

from resilient.snapshot.format import crc


def forge_crc(data: bytes, target: int) -> bytes:
    """``data`` with its last 4 bytes replaced so that its CRC-32C is ``target``."""
    head = bytes(data[:-4])
    base = crc(head + b"\0\0\0\0")
    cols = [crc(head + (1 << i).to_bytes(4, "little")) ^ base for i in range(32)]
    want = base ^ target
    # Gaussian elimination over GF(2): find bits x with XOR of cols[i] for x_i = 1 equal to want
    rows = [(cols[i], 1 << i) for i in range(32)]
    basis: list[tuple[int, int]] = []
    for v, m in rows:
        for bv, bm in basis:
            if v ^ bv < v:
                v, m = v ^ bv, m ^ bm
        if v:
            basis.append((v, m))
            basis.sort(reverse=True)
    x = 0
    for bv, bm in basis:
        if want ^ bv < want:
            want, x = want ^ bv, x ^ bm
    assert want == 0, "CRC-32C is not onto 4 free bytes (cannot happen)"
    out = head + x.to_bytes(4, "little")
    assert crc(out) == target
    return out
