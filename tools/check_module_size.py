"""Fail when a module of the package grows past the size we split at, or a function past 100
lines.

Small modules with one responsibility and functions that fit on a screen are design rules of
zerodp (see docs/style.md); this check keeps them from eroding one commit at a time.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES = 500
MAX_FUNCTION_LINES = 100


def _long_functions(path: Path, source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(
                    f"{path}:{node.lineno}: {node.name} is {lines} lines "
                    f"(limit {MAX_FUNCTION_LINES}); split it"
                )
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "zerodp")
    too_big = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_LINES:
            too_big.append(f"{path}: {lines} lines (limit {MAX_LINES}); split it")
        too_big += _long_functions(path, source)
    for line in too_big:
        print(line, file=sys.stderr)
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
