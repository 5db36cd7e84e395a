"""The docs' code blocks as tests: find every block a user is meant to type, and run it.

A fenced block tagged ``bash``/``sh``/``shell`` or ``python`` in README.md or docs/*.md is
either run by ``tests/integration/test_docs_examples.py`` or marked, in the file itself, on the line
right before its fence::

    <!-- illustrative: needs a GPU fleet and S3 credentials -->

with the reason (a cluster, GPUs, S3 credentials, Slurm, hours of wall time). Untagged
blocks are shown output or diagrams, and ``json``/``yaml``/``toml`` blocks are formats
(docs/format.md's schemas are checked by the format tests): neither is typed.

What the runner changes in a block, and nothing else (:data:`FILLS`): the placeholders a
reader replaces too (``HOST:2379`` and the other etcd endpoints become the test's real
etcd on loopback, ``JOB_ID`` a fresh run id, ``train.py`` a four-line gloo script), and
sizes made small so a block costs seconds (``configs/demo.toml`` is the demo with
:data:`DEMO_SMALL` applied; step counts and process counts shrink). A block that fails
is reported with its file and line (:class:`BlockFailed`).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from resilient.procs import kill_tree

__all__ = ["Block", "BlockFailed", "blocks", "doc_files", "fill", "run_block", "TYPED_LANGS"]

TYPED_LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*illustrative:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    file: Path
    line: int          # the opening fence's line, 1-based
    lang: str          # "bash" or "python"
    text: str
    illustrative: str | None  # the reason given in the file, or None: the block is run

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


class BlockFailed(AssertionError):
    """A docs block that did not run as typed: says its file:line, the command and its output."""


def doc_files(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every bash/python block of ``path`` with its line and illustrative mark (if any).
    A mark with no reason is an error: the reason is what the reader needs."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(2).lower()
        j = i + 1
        while j < len(lines) and not _FENCE.match(lines[j]):
            j += 1
        if lang in TYPED_LANGS:
            prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            mark = _MARK.match(prev)
            reason = mark.group(1) if mark else None
            if mark and not reason:
                raise BlockFailed(f"{path}:{start + 1}: `<!-- illustrative: -->` without a reason")
            found.append(Block(path, start + 1, TYPED_LANGS[lang], "\n".join(lines[start + 1:j]), reason))
        i = j + 1
    return found


# The demo made small: the same model and layout, a few steps.
DEMO_SMALL = {"train.steps": "6", "train.eval_every": "0", "train.log_every": "1",
              "snapshot.durable_every": "2"}

# (pattern, replacement) applied in order; each a placeholder or a size, never the command itself.
FILLS: list[tuple[str, str]] = [
    (r"\bHOST:2379\b|\betcd:2379\b|\betcd-0:2379,etcd-1:2379,etcd-2:2379\b", "{endpoint}"),
    (r"\bJOB_ID\b", "{run_id}"),
    (r"--nproc-per-node[= ]8\b", "--nproc-per-node=2"),
    (r"--steps 200\b", "--steps 3"),
    (r"--set train\.steps=100\b", "--set train.steps=3"),
    (r"--set model\.dim=256\b", "--set model.dim=64"),
    (r"file:///data/", "file://{tmp}/data/"),
]


def fill(text: str, **values: str) -> str:
    for pattern, repl in FILLS:
        text = re.sub(pattern, repl.format(**values), text)
    return text


def run_block(block: Block, cwd: Path, env: dict[str, str], timeout_s: float, **values: str) -> str:
    """Run ``block`` (filled) in ``cwd``; return its output, or raise :class:`BlockFailed` naming
    ``file:line``. A bash block runs under ``set -e``; jobs it starts with ``&`` are waited for,
    and each must succeed."""
    text = fill(block.text, **values)
    if block.lang == "bash":
        # `wait PID` per background job: a plain `wait` would hide a failed agent.
        script = "set -euo pipefail\n" + re.sub(r"(?<!&)&(\s*(#.*)?)$", r"& pids+=($!)\1", text, flags=re.M)
        script = "pids=()\n" + script + '\nfor p in "${pids[@]}"; do wait "$p"; done\n'
        cmd = ["bash", "-c", script]
    else:
        cmd = [env.get("PYTHON", "python"), "-c", text]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise BlockFailed(f"{block.where}: still running after {timeout_s:.0f} s:\n{text}") from exc
    finally:
        kill_tree(proc, timedelta(seconds=10))  # the block's background agents and workers too
    if proc.returncode != 0:
        raise BlockFailed(f"{block.where}: exit {proc.returncode}:\n{text}\n--- output (tail) ---\n{out[-3000:]}")
    return out


def copy_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_JOB_SECRET")}
    env.update(extra)
    return env
