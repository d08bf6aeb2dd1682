"""The package's layering (docs/layout.md): the core never imports the throwaway server,
the process helpers or the demo, which may then change without touching it."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_pglock

PACKAGE = Path(celery_pglock.__file__).parent
OUTSIDE_THE_CORE = ("celery_pglock.testing", "celery_pglock.demo")
# Entry points that start the demo on request (lazily, by name).
ENTRY_POINTS = {"__main__.py", "cli/console.py"}


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_core_imports_neither_the_test_tools_nor_the_demo() -> None:
    core = [
        path
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in ("testing", "demo")
        and str(path.relative_to(PACKAGE)) not in ENTRY_POINTS
    ]
    found = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in _imported(path) if name.startswith(OUTSIDE_THE_CORE)
        )
        for path in core
    }

    assert len(core) > 30
    assert {} == {module: names for module, names in found.items() if names}
