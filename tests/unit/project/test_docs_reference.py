"""The docs and the code name the same flags and knobs (issue 44, item 5).

Both ways: ``docs/cli.md`` (every command's ``--help``) and ``docs/config.md`` (every knob,
from ``resilient config --explain``) are made from the code by ``python
scripts/docs_reference.py``, and a stale page fails here; every ``--flag`` the README and
docs/ pass to a ``resilient`` command exists in that command's help, and every
``section.key`` they name is a knob. A failure names the file and line."""

from __future__ import annotations

import importlib.util
import re

from resilient.gpt.config import explain_all

from launchutil import REPO  # noqa: E402
_spec = importlib.util.spec_from_file_location("docs_reference", REPO / "scripts" / "docs_reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

KNOBS = {line.split(" =", 1)[0] for line in explain_all().splitlines() if " = " in line}
# `section.key` not preceded by a path or a word (`resilient/sdc/x`, `cfg.sdc.x`); `train.py` is a file.
KNOB_RE = re.compile(r"(?<![\w/.-])(" + "|".join(sorted({k.split(".")[0] for k in KNOBS})) + r")\.([a-z_][a-z0-9_]*)\b(?!\.)")
FILE_SUFFIXES = {"py", "toml", "md", "json", "jsonl", "txt", "yaml", "sh"}
# `resilient CMD ...` up to the end of the command (a pipe, a `;`, `&`, the end of a code span).
COMMAND_RE = re.compile(r"\bresilient ([a-z]+)([^|;&`]*)")
FLAG_RE = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def doc_lines():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        if page.relative_to(REPO).as_posix() in reference.PAGES:
            continue  # made from the code: checked by the staleness test
        for number, line in enumerate(page.read_text().splitlines(), 1):
            yield f"{page.relative_to(REPO)}:{number}", line


def flags_of_commands() -> dict[str, set[str]]:
    """Each first word's flags: its own help's and its subcommands'."""
    flags: dict[str, set[str]] = {}
    for words in reference.COMMANDS:
        if words:
            flags.setdefault(words[0], set()).update(FLAG_RE.findall(reference.help_text(words)))
    return flags


def test_the_reference_pages_are_made_from_the_code():
    for rel, make in reference.PAGES.items():
        assert (REPO / rel).read_text() == make(), f"{rel} is stale: run `python scripts/docs_reference.py`"


def unknown_knobs(lines) -> list[str]:
    return [f"{where}: {m.group(0)}" for where, line in lines for m in KNOB_RE.finditer(line)
            if m.group(0) not in KNOBS and m.group(2) not in FILE_SUFFIXES
            and "unknown key" not in line]  # the README quotes the typo error on purpose


def unknown_flags(lines, flags: dict[str, set[str]]) -> list[str]:
    return [f"{where}: resilient {m.group(1)} {flag}" for where, line in lines for m in COMMAND_RE.finditer(line)
            if m.group(1) in flags for flag in FLAG_RE.findall(m.group(2)) if flag not in flags[m.group(1)]]


def test_every_knob_the_docs_name_exists():
    unknown = unknown_knobs(doc_lines())
    assert not unknown, "knobs named in the docs that `resilient config --explain` does not know:\n" + "\n".join(unknown)


def test_every_flag_the_docs_pass_to_resilient_exists():
    unknown = unknown_flags(doc_lines(), flags_of_commands())
    assert not unknown, "flags in the docs that the command's --help does not list:\n" + "\n".join(unknown)


def test_a_flag_or_knob_the_code_does_not_have_is_reported_with_its_line():
    lines = [("README.md:7", "resilient launch configs/demo.toml --run-dir R --set snapshot.evry=5 --no-such-flag"),
             ("docs/x.md:3", "see `resilient ckpt verify URL --secret-file F` and `sdc.abft_every`")]
    assert unknown_knobs(lines) == ["README.md:7: snapshot.evry"]
    assert unknown_flags(lines, flags_of_commands()) == ["README.md:7: resilient launch --no-such-flag"]


def test_the_readme_is_a_front_door_to_the_docs_pages():
    """Issue 40: the README stays short (at most 300 lines) and links every page under docs/,
    whose relative links all resolve."""
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md over 300 lines: move a topic's detail into docs/"
    pages = sorted((REPO / "docs").glob("*.md"))
    unlinked = [p.name for p in pages if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    broken = [(f.name, t) for f in [REPO / "README.md", *pages]
              for t in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", f.read_text())
              if not t.startswith(("http:", "https:", "mailto:")) and not (f.parent / t).exists()]
    assert not broken, f"relative links that lead nowhere: {broken}"


def test_every_rdzv_conf_key_and_environment_variable_is_explained(capsys):
    """Issue 40 item 4: `resilient config --explain` lists every --rdzv-conf key the etcd3 backend
    reads and every RESILIENT_* variable the runtime reads, each with what it is; a key or a
    variable the code reads that the tables lack fails here."""
    import re

    from resilient.cli import main
    from resilient.contract import ENVIRONMENT
    from resilient.rendezvous.registry import RDZV_CONF

    assert main(["config", "--explain"]) == 0
    out = capsys.readouterr().out
    for key in RDZV_CONF:
        assert re.search(rf"(?m)^{key} = .+  # \S", out), f"--explain lacks --rdzv-conf {key}"
    for name in ENVIRONMENT:
        assert re.search(rf"(?m)^{name}  # \S", out), f"--explain lacks ${name}"
    registry = (REPO / "resilient" / "rendezvous" / "registry.py").read_text()
    read = set(re.findall(r'(?:_opt|_seconds)\(params, "(\w+)"', registry))
    read |= set(re.findall(r'get_as_(?:int|bool)\("(\w+)"', registry))
    known = set(RDZV_CONF) | {a for k in RDZV_CONF.values() for a in k.aliases}
    assert read <= known, f"--rdzv-conf keys read but not in RDZV_CONF: {sorted(read - known)}"
    source = "\n".join(p.read_text() for p in (REPO / "resilient").rglob("*.py"))
    named = set(re.findall(r'"(RESILIENT_[A-Z_]+)"', source))
    assert named <= set(ENVIRONMENT), f"variables the runtime names but --explain does not: {sorted(named - set(ENVIRONMENT))}"
