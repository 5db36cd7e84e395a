#!/usr/bin/env python3
"""Write docs/cli.md (every command's --help) and docs/config.md (every knob, from
``resilient config --explain``): the reference pages the README links, made from the code so
that they cannot drift from it. ``tests/unit/project/test_docs_reference.py`` fails when they are stale.

    python scripts/docs_reference.py          # rewrite both pages
    python scripts/docs_reference.py --check  # exit 1 naming the stale page
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The commands whose help the CLI page shows, in the order a user meets them.
COMMANDS = [
    [], ["launch"], ["status"], ["doctor"], ["config"], ["data"],
    ["ckpt"], *[["ckpt", sub] for sub in ("ls", "inspect", "verify", "sign", "reshard", "convert", "import", "diff", "gc")],
    ["store"], ["store", "ls"], ["store", "drop"], ["quarantine"],
    ["chaos"], ["chaos", "run"], ["chaos", "report"],
]


def help_text(words: list[str]) -> str:
    """What ``resilient WORDS --help`` prints, at a fixed width (argparse wraps to $COLUMNS)."""
    from resilient.cli import main

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            main([*words, "--help"] if words else ["--help"])
    except SystemExit:
        pass
    finally:  # the caller's width (a test process's) stays as it was
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue().rstrip() + "\n"


def cli_page() -> str:
    parts = ["# `resilient` commands\n\n",
             "Every command's `--help`, as the code prints it (made by `python scripts/docs_reference.py`;\n"
             "a test fails when this page is stale). The README shows them in use.\n"]
    for words in COMMANDS:
        parts.append(f"\n## `resilient {' '.join(words)}`\n\n```text\n{help_text(words)}```\n".replace("resilient `", "resilient`"))
    return "".join(parts)


def config_page() -> str:
    from resilient.gpt.config import explain_all

    sections: dict[str, list[str]] = {}
    for line in explain_all().splitlines():
        if line.strip():
            sections.setdefault(line.split(".", 1)[0], []).append(line)
    parts = ["# Config knobs\n\n",
             "Every knob of a run config (TOML section `[name]`, or `--set name.key=value`), its default\n"
             "and what it does, as `resilient config --explain` prints them (made by `python\n"
             "scripts/docs_reference.py`; a test fails when this page is stale). Ranges are checked when the\n"
             "config is read, before anything imports torch.\n"]
    for name, lines in sections.items():
        parts.append(f"\n## `[{name}]`\n\n```text\n" + "\n".join(lines) + "\n```\n")
    from resilient.contract import explain_environment
    from resilient.rendezvous.registry import explain_rdzv_conf

    parts.append("\n## `--rdzv-conf` keys\n\nWhat `resilient launch --rdzv-conf k=v,...` and `torchrun "
                 "--rdzv-backend etcd3 --rdzv-conf ...` read (durations in seconds; None: unset, the handler's "
                 "own default).\n\n```text\n" + "\n".join(explain_rdzv_conf()) + "\n```\n")
    parts.append("\n## Environment variables\n\nEvery variable the runtime reads: those you may set, then those "
                 "`resilient launch` sets for its workers.\n\n```text\n" + "\n".join(explain_environment())
                 + "\n```\n")
    return "".join(parts)


PAGES = {"docs/cli.md": cli_page, "docs/config.md": config_page}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    stale = []
    for rel, make in PAGES.items():
        text, path = make(), REPO / rel
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run `python scripts/docs_reference.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
