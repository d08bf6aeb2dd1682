"""docs/layout.md lists the layers that import-linter enforces (``lint-imports``, run by
``make lint``): the page and the contract in pyproject.toml never drift apart."""

from __future__ import annotations

import re
import sys
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
