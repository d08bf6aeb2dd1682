"""docs/layout.md lists the layers that import-linter enforces (``lint-imports``, run by
``make lint``): the page and the contract in pyproject.toml never drift apart. And the
package's words stay apart: no local name hides a module its file imports."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
MODULE = re.compile(r"^[a-z_]+(?: \| [a-z_]+)*")


def contract_layers() -> list[str]:
    """The layers of the contract "Imports point down the layers", top to bottom."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [layers] = [
        contract["layers"]
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract["name"] == "Imports point down the layers"
    ]
    return list(layers)


def documented_layers() -> list[str]:
    """The layers docs/layout.md draws: the first column of its first code block."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = text.split("```", 2)[1]
    found = (MODULE.match(line) for line in block.splitlines())
    return [match.group(0) for match in found if match]


def test_docs_layout_lists_the_enforced_layers_in_order() -> None:
    """Every layer of the import contract is on the page, in the contract's order, with
    the same modules, and the page lists no other."""
    assert contract_layers() == documented_layers()


def modules_imported(tree: ast.Module) -> dict[str, str]:
    """The names a module binds to modules by importing them: name -> module."""
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update({(a.asname or a.name).split(".")[0]: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_module(full):
                    found[alias.asname or alias.name] = full
    return found


def _is_module(name: str) -> bool:
    """Looked up on disk, imported never (a Django module may need its settings)."""
    package, _, leaf = name.rpartition(".")
    try:
        spec = importlib.util.find_spec(package)
    except (ModuleNotFoundError, ValueError):  # not installed; a lazy module (kombu)
        return False
    places = spec.submodule_search_locations or [] if spec else []
    return any(
        (Path(place) / f"{leaf}.py").is_file() or (Path(place) / leaf / "__init__.py").is_file()
        for place in places
    )


def names_bound(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Every local name a module binds: arguments and assignment targets."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            yield from ((arg.arg, arg.lineno) for arg in arguments)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno


def test_no_local_name_shadows_a_module_its_file_imports() -> None:
    """A parameter or variable named like a module its file imports (``policy`` in a
    file that calls ``policy.claim``) hides the module for the rest of its scope."""
    shadowing = []
    for path in sorted((ROOT / "celery_pglock").rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = modules_imported(tree)
        shadowing += [
            f"{path.relative_to(ROOT)}:{line}: {name} shadows {imported[name]}"
            for name, line in names_bound(tree)
            if name in imported
        ]
    assert shadowing == []


TOOLS = ("demo", "testing")  # outside the core: a throwaway server, the demo's own


def imports_of(tree: ast.Module) -> Iterator[str]:
    """Every module a file imports, by its full name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def above_the_store() -> Iterator[tuple[Path, ast.Module]]:
    """Every module of the core above the store (the test tools and the demo aside)."""
    layers = contract_layers()
    below = {
        module for layer in layers[layers.index("store") + 1 :] for module in layer.split(" | ")
    }
    for path in sorted((ROOT / "celery_pglock").rglob("*.py")):
        first = path.relative_to(ROOT / "celery_pglock").parts[0].removesuffix(".py")
        if first not in {"store", *below, *TOOLS}:
            yield path.relative_to(ROOT), ast.parse(path.read_text())


def test_above_the_store_no_module_imports_the_driver() -> None:
    """psycopg is the store's: a module above it names a statement and gets rows or the
    library's errors. Below it (SQL text, a DSN's check) psycopg's own helpers are used."""
    found = [
        f"{path}: {name}"
        for path, tree in above_the_store()
        for name in imports_of(tree)
        if name.split(".")[0] == "psycopg"
    ]
    assert found == []


def test_above_the_store_no_module_runs_sql_or_translates_errors_itself() -> None:
    """Above the store a statement runs by its name through the store, which translates
    the driver's errors once: no ``execute`` call, no ``boundary`` of its own."""
    found = [
        f"{path}:{node.lineno}: {name}"
        for path, tree in above_the_store()
        for node in ast.walk(tree)
        if (name := _sql_call(node)) is not None
    ]
    assert found == []


def _sql_call(node: ast.AST) -> str | None:
    """``execute`` or ``executemany`` called on anything, or ``boundary`` called."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Attribute) and node.func.attr in {"execute", "executemany"}:
        return node.func.attr
    if isinstance(node.func, ast.Name) and node.func.id == "boundary":
        return "boundary"
    return None


# The modules a project may import (docs/layout.md), and the entry points pyproject.toml names.
PUBLIC = {
    "errors", "signals", "schema", "ops", "retention", "metrics", "schedules",
    "beat", "web", "web.security", "steering", "steering.actions", "store", "store.statements",
    "testing", "testing.embedded", "testing.plugin", "demo", "cli", "cli.command", "cli.console",
}  # fmt: skip


def test_a_module_the_docs_do_not_name_is_private() -> None:
    """structlog's shape: the package's face is its ``__all__`` and the documented modules;
    every other module has a leading underscore (Django's own modules in ``contrib`` keep
    the names Django looks them up by)."""
    found = []
    for path in sorted((ROOT / "celery_pglock").rglob("*.py")):
        parts = path.relative_to(ROOT / "celery_pglock").with_suffix("").parts
        if parts[-1] in {"__init__", "__main__"}:
            parts = parts[:-1]
        dotted = ".".join(parts)
        if not parts or parts[0] == "contrib" or any(p.startswith("_") for p in parts):
            continue
        if dotted not in PUBLIC:
            found.append(dotted)
    assert found == []
