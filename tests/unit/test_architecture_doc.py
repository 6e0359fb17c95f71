"""docs/architecture.md's import table says what the code imports and what the contracts forbid.

Each row names one module or package of zerodp (relative to `zerodp.`; `zerodp` itself is
the package root). Its second cell must list exactly the rows its modules import directly
(from the code, as import-linter sees it), and its third exactly what the lint-imports
contracts in pyproject.toml forbid it (the contracts whose source is the row or a package
above it). A module no row covers fails too: a new package gets a row.
`python tools/architecture_table.py --write` rewrites the two computed cells.
"""

from __future__ import annotations

import grimp

from tools import architecture_table as table


def test_the_import_table_is_what_the_code_imports() -> None:
    rows = table.rows()
    assert len(rows) > 20, f"no import table found under '{table.SECTION}' in {table.DOC}"
    graph = grimp.build_graph("zerodp")
    missing = table.uncovered(rows, graph)
    assert not missing, f"docs/architecture.md's import table has no row for {missing}"
    wrong = table.differences(
        {row: listed for row, (listed, _) in rows.items()}, table.actual_imports(rows, graph)
    )
    assert not wrong, (
        f"docs/architecture.md's 'imports' column is not the code's: {wrong} "
        "(python tools/architecture_table.py --write)"
    )


def test_the_import_table_says_what_the_contracts_forbid() -> None:
    rows = table.rows()
    wrong = table.differences(
        {row: listed for row, (_, listed) in rows.items()}, table.forbidden_imports(rows)
    )
    assert not wrong, (
        f"docs/architecture.md's 'never imports' column is not the contracts': {wrong} "
        "(python tools/architecture_table.py --write)"
    )
