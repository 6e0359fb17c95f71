"""Every `zerodp.<name>` the README and docs/ mention exists (a renamed or unexported name in
the docs is a user's AttributeError), every import statement they show runs, none of them
names an old import path (`zerodp.old_paths`), and every repository path they name exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import zerodp
from zerodp.old_paths import MOVED

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "README.md",
    ROOT / "examples" / "README.md",
]
NAME = re.compile(r"`(zerodp(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![A-Za-z0-9_*])")  # not `a.b_*`
# `from zerodp.x import a, b` and `import zerodp.x`, in code blocks or inline.
FROM_IMPORT = re.compile(r"^\s*from (zerodp(?:\.\w+)*) import ([\w, ]+)", re.MULTILINE)
IMPORT = re.compile(r"^\s*import (zerodp(?:\.\w+)*)\b", re.MULTILINE)
# A repository path in backticks: `zerodp/engine/facade.py`, `tests/unit/x.py::test_y`.
PATH = re.compile(r"`((?:zerodp|tests|bench|examples|tools|docs)/[\w./-]+)(?:::[^`]*)?`")


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


def _imports(text: str) -> list[str]:
    """The dotted names the page's import statements bring in."""
    names = list(IMPORT.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        names += [f"{module}.{name.strip()}" for name in imported.split(",") if name.strip()]
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_import_statement_in_the_docs_works(page: Path) -> None:
    names = sorted(set(_imports(page.read_text())))
    missing = [name for name in names if not _resolves(name)]
    assert not missing, f"{page.name} shows imports that fail: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_names_an_old_import_path(page: Path) -> None:
    text = page.read_text()
    names = set(NAME.findall(text)) | set(_imports(text))
    old = sorted(n for n in names if any(n == o or n.startswith(o + ".") for o in MOVED))
    assert not old, f"{page.name} names old import paths (see zerodp.old_paths.MOVED): {old}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_in_the_docs_exists(page: Path) -> None:
    paths = sorted(set(PATH.findall(page.read_text())))
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"{page.name} names paths the repository does not have: {missing}"
