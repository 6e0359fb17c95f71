"""Every `zerodp.<name>` the README and docs/ mention exists (a renamed or unexported name in
the docs is a user's AttributeError)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import zerodp

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAME = re.compile(r"`(zerodp(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![A-Za-z0-9_*])")  # not `a.b_*`


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                target = getattr(target, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_zerodp_name_in_the_docs_exists(page: Path) -> None:
    names = sorted(set(NAME.findall(page.read_text())))
    missing = [name for name in names if not _resolves(name)]
    assert not missing, f"{page.name} names what zerodp does not have: {missing}"


def test_the_error_types_users_catch_are_exported() -> None:
    for name in ("PeerFailedError", "UnevenInputsError", "NonScalarLossError", "DivergenceError"):
        assert issubclass(getattr(zerodp, name), zerodp.ZeroDPError)
    assert issubclass(zerodp.NonScalarLossError, AssertionError)
