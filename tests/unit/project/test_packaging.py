"""The package list in pyproject.toml covers every package folder."""

from __future__ import annotations

import tomllib

from launchutil import REPO


def test_every_package_folder_is_listed():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    roots = {name: REPO / folder for name, folder in project["package-dir"].items() if name}
    roots["resilient"] = REPO / "resilient"
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"add to pyproject.toml: {sorted(found - listed)}; remove: {sorted(listed - found)}"
