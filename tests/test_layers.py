"""The tree's layers, checked on the source: the runtime never imports its users, and the
built-in GPT uses nothing of the runtime but the public API (issue 22: "the trainer
imports only the public API and torch").

    users:    resilient.gpt · resilient_tools · resilient_chaos · resilient.integrations
    public:   resilient.job · resilient.runconfig · resilient.configbase · resilient.errors
    runtime:  everything else under resilient/ (agent, rendezvous, etcd, snapshot, sdc, ...)

``resilient.cli`` is the command line: it dispatches to every layer and is above them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

from launchutil import REPO

PKG = REPO / "resilient"
USERS = ("resilient.gpt", "resilient.integrations", "resilient_tools", "resilient_chaos")
PUBLIC = ("resilient.job", "resilient.runconfig", "resilient.configbase", "resilient.errors")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (functions' lazy imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_runtime_never_imports_its_users():
    bad = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("resilient/gpt/", "resilient/integrations/")) or rel == "resilient/cli.py":
            continue
        found = sorted(m for m in imports(path) if under(m, USERS))
        if found:
            bad[rel] = found
    assert not bad, f"runtime modules import the layer above them: {bad}"


def test_the_builtin_gpt_uses_only_the_public_api():
    # Its launch program (gpt/program.py) also describes itself to the launcher: Program.
    allowed = PUBLIC + ("resilient.gpt",)
    bad = {}
    for path in (PKG / "gpt").glob("*.py"):
        extra = ("resilient.launch",) if path.name == "program.py" else ()
        found = sorted(m for m in imports(path) if under(m, ("resilient",)) and not under(m, allowed + extra))
        found += sorted(m for m in imports(path) if m == "resilient")
        if found:
            bad[path.name] = found
    assert not bad, f"the built-in trainer reaches past the public API: {bad}"


def test_the_examples_use_only_the_public_api():
    for path in (REPO / "examples").glob("*.py"):
        found = [m for m in imports(path) if under(m, ("resilient",)) and m != "resilient"
                 and not under(m, PUBLIC + ("resilient.integrations",))]
        assert not found, f"{path.name} imports {found}"
