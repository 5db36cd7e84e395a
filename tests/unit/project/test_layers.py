"""The tree's layers, checked on the source: the runtime never imports its users, and the
built-in GPT uses nothing of the runtime but the public API (issue 22: "the trainer
imports only the public API and torch").

    users:    resilient.gpt · resilient_tools · resilient_chaos · resilient.integrations
    public:   resilient.job · resilient.runconfig · resilient.configbase · resilient.errors
    runtime:  everything else under resilient/ (agent, rendezvous, etcd, snapshot, sdc, ...)

``resilient.cli`` is the command line: it dispatches to every layer and is above them all.

Inside the runtime every part (a subpackage or a top-level module of ``resilient``) has a
place in :data:`RUNTIME_LAYERS`, and imports only parts of the layers below its own (issue
40: no import cycle, lazy imports included). The agent and its workers meet only in
:mod:`resilient.contract`, at the bottom: neither ``agent`` nor ``job`` imports the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from launchutil import REPO

PKG = REPO / "resilient"
USERS = ("resilient.gpt", "resilient.integrations", "resilient_tools", "resilient_chaos")
PUBLIC = ("resilient.job", "resilient.runconfig", "resilient.configbase", "resilient.errors")

# Bottom first. A part imports only parts of lower layers; parts of one layer never import each other.
RUNTIME_LAYERS = (
    ("errors",),
    ("rundir", "procs", "shipped", "launch_args", "contract", "progress", "optim_state"),
    ("configbase", "secret", "events", "etcd"),
    ("ledger", "rendezvous"),                      # the records' copies; torchrun's etcd backend
    ("control", "snapshot"),                       # the control plane (and reaching it from outside); the tiers
    ("sdc", "failslow", "preflight"),              # the checks a worker runs; the checks before a launch
    ("runconfig",),                                # every runtime section, each owned by its part
    ("agent", "job"),                              # the node's supervisor; the worker's API
    ("observe",),                                  # an operator's view from outside
    ("launch",),                                   # one node's launch: a program, an agent, etcd
    ("commands",),                                 # the other commands: quarantine, status, store, doctor
)


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


def _part(module: str) -> str | None:
    bits = module.split(".")
    return bits[1] if bits[0] == "resilient" and len(bits) > 1 else None


def test_every_import_inside_the_runtime_goes_down_a_layer():
    rank = {part: i for i, layer in enumerate(RUNTIME_LAYERS) for part in layer}
    parts = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__pycache__"}
    above = {"__init__", "cli", "gpt", "integrations"}   # the package's face, the command line, the users
    assert parts - above == set(rank), f"a runtime part without a layer (or a layer without a part): " \
                                       f"{sorted((parts - above) ^ set(rank))}"
    bad = []
    for path in PKG.rglob("*.py"):
        src = _part(path.relative_to(REPO).with_suffix("").as_posix().replace("/", "."))
        if src not in rank:
            continue
        for module in imports(path):
            dst = _part(module)
            if dst in rank and dst != src and rank[dst] >= rank[src]:
                bad.append(f"{path.relative_to(REPO)} ({src}, layer {rank[src]}) imports {module} "
                           f"({dst}, layer {rank[dst]})")
    assert not bad, "imports that go up or sideways inside the runtime:\n" + "\n".join(sorted(bad))


def test_the_runtime_never_imports_pytest():
    bad = sorted(path.relative_to(REPO).as_posix() for path in PKG.rglob("*.py")
                 if any(under(m, ("pytest", "_pytest")) for m in imports(path)))
    assert not bad, f"runtime modules import pytest (test helpers belong in resilient_chaos or tests/): {bad}"
