"""docs/architecture.md's import table, from the code and the contracts: checked and rewritten.

Each row of the table under "## Which modules may import which" names one module or package
of zerodp (relative to `zerodp.`; `zerodp` itself is the package root). Its second cell lists
the rows its modules import directly (as import-linter's graph sees them), its third what the
lint-imports contracts in pyproject.toml forbid it (the contracts whose source is the row or
a package above it). `tests/unit/test_architecture_doc.py` holds the doc to these;
`python tools/architecture_table.py --write` rewrites both cells of every row (the rows, their
order and the first cell stay the author's: a new package still needs its row).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import grimp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (tomllib's origin, from PyPI)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Which modules may import which"
NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)`")
Rows = dict[str, tuple[set[str], set[str]]]


def _names(cell: str) -> set[str]:
    return set(NAME.findall(cell))


def _section(text: str) -> tuple[int, int]:
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return start, len(text) if end < 0 else end


def _row_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rows(text: str | None = None) -> Rows:
    """row name -> (the names in its "imports" cell, the names in its "never" cell)."""
    text = DOC.read_text() if text is None else text
    start, end = _section(text)
    found: Rows = {}
    for line in text[start:end].splitlines():
        cells = _row_cells(line)
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        (name,) = _names(cells[0])
        found[name] = (_names(cells[1]), _names(cells[2]))
    return found


def relative(module: str) -> str:
    return "zerodp" if module == "zerodp" else module.removeprefix("zerodp.")


def row_of(module: str, table: Rows) -> str | None:
    """The row that covers `module`: the longest row name that is it or a package above it."""
    name = relative(module)
    if name == "zerodp":
        return "zerodp" if "zerodp" in table else None
    covering = [r for r in table if r != "zerodp" and (name == r or name.startswith(r + "."))]
    return max(covering, key=len, default=None)


def _covers(source: str, row: str) -> bool:
    return row == source or row.startswith(source + ".")


def uncovered(table: Rows, graph: grimp.ImportGraph) -> list[str]:
    return sorted(m for m in graph.modules if row_of(m, table) is None)


def actual_imports(table: Rows, graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Per row, the rows its modules import directly."""
    imports: dict[str, set[str]] = {row: set() for row in table}
    for module in graph.modules:
        row = row_of(module, table)
        for imported in graph.find_modules_directly_imported_by(module):
            target = row_of(imported, table)
            if row is not None and target is not None and target != row:
                imports[row].add(target)
    return imports


def forbidden_imports(table: Rows) -> dict[str, set[str]]:
    """Per row, what the forbidden contracts whose source covers it forbid."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden: dict[str, set[str]] = {row: set() for row in table}
    for contract in config["contracts"]:
        # The root's own contract (`as_packages = false`) is stated in the text instead.
        if contract["type"] != "forbidden" or not contract.get("as_packages", True):
            continue
        sources = [relative(s) for s in contract["source_modules"]]
        for row in table:
            if any(_covers(source, row) for source in sources):
                forbidden[row] |= {relative(m) for m in contract["forbidden_modules"]}
    return forbidden


def differences(
    documented: dict[str, set[str]], actual: dict[str, set[str]]
) -> dict[str, dict[str, list[str]]]:
    """Per row: what the doc lacks and what it lists wrongly."""
    return {
        row: {"add": sorted(actual[row] - listed), "remove": sorted(listed - actual[row])}
        for row, listed in documented.items()
        if listed != actual[row]
    }


def _cell(names: set[str], order: list[str]) -> str:
    if not names:
        return "nothing"
    rank = {name: i for i, name in enumerate(order)}
    return ", ".join(f"`{n}`" for n in sorted(names, key=lambda n: (rank.get(n, len(rank)), n)))


def rewrite() -> None:
    """Both computed cells of every row, in the table's row order."""
    text = DOC.read_text()
    table = rows(text)
    order = list(table)
    imports = actual_imports(table, grimp.build_graph("zerodp"))
    never = forbidden_imports(table)
    start, end = _section(text)
    lines = text[start:end].split("\n")
    for i, line in enumerate(lines):
        cells = _row_cells(line)
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        (name,) = _names(cells[0])
        never_cell = "—" if not never[name] else _cell(never[name], order)
        lines[i] = f"| {cells[0]} | {_cell(imports[name], order)} | {never_cell} |"
    DOC.write_text(text[:start] + "\n".join(lines) + text[end:])


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        rewrite()
    graph = grimp.build_graph("zerodp")
    table = rows()
    missing = uncovered(table, graph)
    wrong = differences(
        {r: listed for r, (listed, _) in table.items()}, actual_imports(table, graph)
    )
    print("rows missing for:", missing or "none", "| cells differing:", wrong or "none")
    sys.exit(1 if missing or wrong else 0)
