"""Old import paths: a public helper's keeps working with a DeprecationWarning naming the new
path; an internal module's fails with an ImportError naming it. And the package root stays
within its cap of six modules (besides `__init__.py` and `version.py`)."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

import zerodp
from zerodp.old_paths import MOVED, moved_from
from zerodp.version import __version__

PUBLIC = sorted(old for old, moved in MOVED.items() if moved.public)
INTERNAL = sorted(old for old, moved in MOVED.items() if not moved.public)


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """Make the next import of `old` go through the finder again (as in a fresh process)."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    parent, _, child = old.rpartition(".")
    if parent in sys.modules and child in vars(sys.modules[parent]):  # not hasattr: imports
        monkeypatch.delattr(sys.modules[parent], child)


def test_both_kinds_are_listed() -> None:
    assert PUBLIC
    assert INTERNAL


@pytest.mark.parametrize("old", PUBLIC)
def test_a_public_old_path_is_the_new_module_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    _forget(monkeypatch, old)
    new = importlib.import_module(MOVED[old].new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new  # one module object: its classes and isinstance checks are the same
    messages = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert MOVED[old].new in str(messages[0].message)
    assert messages[0].filename == __file__  # shown at the importing line, not in importlib


@pytest.mark.parametrize("old", PUBLIC)
def test_a_public_old_path_works_with_from_import_and_as_an_attribute(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    new = importlib.import_module(MOVED[old].new)
    name = old.rpartition(".")[2]
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=MOVED[old].new):
        exec(f"from zerodp import {name} as module", namespace := {})
    assert namespace["module"] is new
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=MOVED[old].new):
        assert getattr(zerodp, name) is new


def test_the_old_gathered_parameters_is_the_class_users_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forget(monkeypatch, "zerodp.gathered")
    with pytest.warns(DeprecationWarning, match="zerodp.full_state.gathered_parameters"):
        from zerodp.gathered import GatheredParameters
    assert GatheredParameters is zerodp.zero.GatheredParameters


@pytest.mark.parametrize("old", INTERNAL)
def test_an_internal_old_path_fails_naming_the_new_one(
    monkeypatch: pytest.MonkeyPatch, old: str
) -> None:
    importlib.import_module(MOVED[old].new)  # the new path works
    new = MOVED[old].new.replace(".", r"\.")
    parent, _, name = old.rpartition(".")
    _forget(monkeypatch, old)
    with pytest.raises(ImportError, match=new):
        importlib.import_module(old)
    with pytest.raises(ImportError, match=new):  # not just "cannot import name ..."
        exec(f"from {parent} import {name}", {})
    assert old not in sys.modules
    if parent == "zerodp":  # a root module, as an attribute: AttributeError, so hasattr works
        with pytest.raises(AttributeError, match=new):
            getattr(zerodp, name)
        assert not hasattr(zerodp, name)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


def test_every_old_path_is_retired_on_time() -> None:
    """[Note: retiring old paths]: an entry whose release has come must be removed."""
    for old, moved in MOVED.items():
        assert _release(__version__) < _release(moved.removed_in), (
            f"{old} was to be removed in zerodp {moved.removed_in} (this is {__version__}): "
            "remove its entry from zerodp/old_paths/finder.py and its row in "
            "docs/architecture.md"
        )


def test_a_public_moved_packages_modules_are_the_new_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zerodp.checkpoint_io import consolidate

    _forget(monkeypatch, "zerodp.checkpoint")
    _forget(monkeypatch, "zerodp.checkpoint.consolidate")
    with pytest.warns(DeprecationWarning, match=r"zerodp\.checkpoint_io\.consolidate"):
        from zerodp.checkpoint.consolidate import consolidate_checkpoint
    assert consolidate_checkpoint is consolidate.consolidate_checkpoint
    assert sys.modules["zerodp.checkpoint.consolidate"] is consolidate  # one module object


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("zerodp.params.coordinator", "zerodp.stage3"),
        ("zerodp.group.state", "zerodp.group_state"),
        ("zerodp.config.compat.aliases", "zerodp.config.deepspeed_keys"),
    ],
)
def test_an_internal_moved_packages_modules_fail_naming_their_new_paths(old: str, new: str) -> None:
    """The import system imports the old parent first, so its message names the package and
    says that its modules moved with it."""
    importlib.import_module(old.replace(old.rsplit(".", 1)[0], new))
    assert moved_from(old) is not None
    with pytest.raises(ImportError, match=new.replace(".", r"\.")):
        importlib.import_module(old)
    assert old not in sys.modules


def test_the_finder_answers_only_its_own_names() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        zerodp.no_such_module  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'zerodp\.no_such_module'"):
        importlib.import_module("zerodp.no_such_module")


def test_no_old_path_is_a_module_again() -> None:
    """A module at an old path again would be found before the finder (it comes last)."""
    root = Path(zerodp.__file__).parent
    for old in MOVED:
        relative = Path(*old.split(".")[1:])
        assert not (root / relative).with_suffix(".py").exists(), old
        assert not (root / relative).is_dir(), old


def test_the_package_root_holds_at_most_six_modules() -> None:
    root = Path(zerodp.__file__).parent
    modules = sorted(
        p.name for p in root.glob("*.py") if p.name not in {"__init__.py", "version.py"}
    )
    assert len(modules) <= 6, modules


def test_docs_architecture_lists_every_old_path() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    section = text.split("## Old import paths", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, tuple[str, bool]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            old, new = cells[0].strip("`").removesuffix(".*"), cells[1].strip("`")
            new = new.removesuffix(".*")
            listed[f"zerodp.{old}"] = (new, cells[2].startswith("works"), cells[3])
    assert listed == {
        old: (moved.new, moved.public, moved.removed_in) for old, moved in MOVED.items()
    }
