"""The block schedule of bench_overhead.py, shared by its hook (sitecustomize.py here) and the row."""

from __future__ import annotations

ENV = "RESILIENT_BENCH_BLOCKS"


def parse(spec: str) -> tuple[int, int, list[str]]:
    warmup, block, modes = spec.split(":")
    return int(warmup), int(block), modes.split(",")


def mode_of(step: int, spec: str) -> str | None:
    """The mode of step ``step``, or None during warm-up (everything on)."""
    warmup, block, modes = parse(spec)
    if step <= warmup:
        return None
    b = (step - warmup - 1) // block
    cycle, pos = divmod(b, len(modes))
    return modes[(pos + cycle) % len(modes)]


def cycle_of(step: int, spec: str) -> int:
    warmup, block, modes = parse(spec)
    return (step - warmup - 1) // block // len(modes)
