"""Fail when a module of the package grows past the size we split at.

Small modules with one responsibility are a design rule of zerodp (see
docs/style.md); this check keeps the rule from eroding one commit at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 500


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "zerodp")
    too_big = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_big.append(f"{path}: {lines} lines (limit {MAX_LINES}); split it")
    for line in too_big:
        print(line, file=sys.stderr)
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
