"""docs/architecture.md's import table says what the code imports and what the contracts forbid.

Each row names one module or package of zerodp (relative to `zerodp.`; `zerodp` itself is
the package root). Its second cell must list exactly the rows its modules import directly
(from the code, as import-linter sees it), and its third exactly what the lint-imports
contracts in pyproject.toml forbid it (the contracts whose source is the row or a package
above it). A module no row covers fails too: a new package gets a row.
"""

from __future__ import annotations

import re
from pathlib import Path

import grimp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (tomllib's origin, from PyPI)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Which modules may import which"
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)`")


def _names(cell: str) -> set[str]:
    return set(NAME.findall(cell))


def _rows() -> dict[str, tuple[set[str], set[str]]]:
    """row name -> (the names in its "imports" cell, the names in its "never" cell)."""
    text = DOC.read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        (name,) = _names(cells[0])
        rows[name] = (_names(cells[1]), _names(cells[2]))
    return rows


def _relative(module: str) -> str:
    return "zerodp" if module == "zerodp" else module.removeprefix("zerodp.")


def _row_of(module: str, rows: dict[str, tuple[set[str], set[str]]]) -> str | None:
    """The row that covers `module`: the longest row name that is it or a package above it."""
    name = _relative(module)
    if name == "zerodp":
        return "zerodp" if "zerodp" in rows else None
    covering = [r for r in rows if r != "zerodp" and (name == r or name.startswith(r + "."))]
    return max(covering, key=len, default=None)


def _covers(source: str, row: str) -> bool:
    return row == source or row.startswith(source + ".")


def _differences(
    documented: dict[str, set[str]], actual: dict[str, set[str]]
) -> dict[str, dict[str, list[str]]]:
    """Per row: what the doc lacks and what it lists wrongly."""
    return {
        row: {"add": sorted(actual[row] - listed), "remove": sorted(listed - actual[row])}
        for row, listed in documented.items()
        if listed != actual[row]
    }


def test_the_import_table_is_what_the_code_imports() -> None:
    rows = _rows()
    assert len(rows) > 20, f"no import table found under '{SECTION}' in {DOC}"
    graph = grimp.build_graph("zerodp")
    uncovered = sorted(m for m in graph.modules if _row_of(m, rows) is None)
    assert not uncovered, f"docs/architecture.md's import table has no row for {uncovered}"
    imports: dict[str, set[str]] = {row: set() for row in rows}
    for module in graph.modules:
        row = _row_of(module, rows)
        for imported in graph.find_modules_directly_imported_by(module):
            target = _row_of(imported, rows)
            if row is not None and target is not None and target != row:
                imports[row].add(target)
    wrong = _differences({row: listed for row, (listed, _) in rows.items()}, imports)
    assert not wrong, f"docs/architecture.md's 'imports' column is not the code's: {wrong}"


def test_the_import_table_says_what_the_contracts_forbid() -> None:
    rows = _rows()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden: dict[str, set[str]] = {row: set() for row in rows}
    for contract in config["contracts"]:
        # The root's own contract (`as_packages = false`) is stated in the text instead.
        if contract["type"] != "forbidden" or not contract.get("as_packages", True):
            continue
        sources = [_relative(s) for s in contract["source_modules"]]
        for row in rows:
            if any(_covers(source, row) for source in sources):
                forbidden[row] |= {_relative(m) for m in contract["forbidden_modules"]}
    wrong = _differences({row: listed for row, (_, listed) in rows.items()}, forbidden)
    assert not wrong, (
        f"docs/architecture.md's 'never imports' column is not the contracts': {wrong}"
    )
