"""Which deprecation warnings zerodp caused: told by the stack, wherever they are attributed.

The code under each case is compiled with a file name where the rule looks (zerodp's
package, an installed library, a test), so each arrangement of callers is built exactly:
a library that attributes the warning to the deprecated function itself (transformers'
`warnings.warn` without a stacklevel) or to a wrapper of it (torch's collectives under
their logging wrapper), a library calling its own deprecated API, zerodp's own warning to
its caller. The workers' side, with torch's own deprecated collective, is in
tests/distributed/test_caused_warnings.py.
"""

from __future__ import annotations

import os
import sysconfig
import warnings
from collections.abc import Callable
from typing import Any

import pytest

import zerodp
from zerodp.testing.caused_warnings import deprecations_caused_by_zerodp

PACKAGE = os.path.dirname(os.path.realpath(zerodp.__file__))
LIBRARY = os.path.join(os.path.realpath(sysconfig.get_paths()["purelib"]), "some_library")

LIBRARY_SOURCE = """
import warnings

from typing_extensions import deprecated as deprecation


def deprecated():
    warnings.warn("deprecated() is deprecated", FutureWarning)


def logged(fn):
    def wrapper(*args):
        return fn(*args)

    return wrapper


@logged
@deprecation("decorated() is deprecated", category=FutureWarning)
def decorated():
    pass


def uses_its_own_deprecated_api():
    deprecated()


def names_its_own_line():
    warnings.warn("named at the caller", DeprecationWarning, stacklevel=2)


def uses_a_deprecated_api_naming_its_caller():
    names_its_own_line()
"""


def load(path: str, source: str, names: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `source` as if it were the file `path`; its globals."""
    scope: dict[str, Any] = dict(names or {})
    exec(compile(source, path, "exec"), scope)
    return scope


LIB = load(os.path.join(LIBRARY, "api.py"), LIBRARY_SOURCE)


def zerodp_calls(target: Callable[[], None]) -> Callable[[], None]:
    """`target` called from a line of zerodp's package."""
    scope = load(
        os.path.join(PACKAGE, "made_up.py"), "def call():\n    target()\n", {"target": target}
    )
    return scope["call"]


def caught(action: Callable[[], None]) -> list[str]:
    with warnings.catch_warnings(record=True), deprecations_caused_by_zerodp() as caused:
        warnings.simplefilter("always")
        action()
    return [w.caller for w in caused]


@pytest.mark.parametrize("name", ["deprecated", "decorated", "names_its_own_line"])
def test_a_deprecated_library_call_made_by_zerodp_is_zerodps(name: str) -> None:
    """Attributed to the deprecated function itself (transformers), to a wrapper around a
    decorated one (torch's collectives), or to zerodp's line (the right stacklevel)."""
    assert caught(zerodp_calls(LIB[name])) == ["zerodp/made_up.py:2"]


@pytest.mark.parametrize(
    "name", ["uses_its_own_deprecated_api", "uses_a_deprecated_api_naming_its_caller"]
)
def test_a_library_using_its_own_deprecated_api_is_the_librarys(name: str) -> None:
    """The HF Trainer's own use of a deprecated method, reached through zerodp's subclass."""
    assert caught(zerodp_calls(LIB[name])) == []


@pytest.mark.parametrize("name", ["deprecated", "decorated", "names_its_own_line"])
def test_a_tests_own_call_is_not_zerodps(name: str) -> None:
    assert caught(LIB[name]) == []


def test_zerodps_own_warning_to_its_caller_is_not_counted() -> None:
    """An old import path: zerodp warns, attributed to whoever imported it."""
    source = "import warnings\ndef old():\n    warnings.warn('moved', DeprecationWarning, 2)\n"
    old = load(os.path.join(PACKAGE, "made_up_finder.py"), source)["old"]
    assert caught(old) == []
    assert caught(zerodp_calls(old)) == ["zerodp/made_up.py:2"]  # zerodp's own old path


def test_other_warnings_go_where_they_went() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with deprecations_caused_by_zerodp() as caused:
            LIB["deprecated"]()
            zerodp_calls(LIB["deprecated"])()
    assert [str(w.message) for w in seen] == ["deprecated() is deprecated"]
    assert len(caused) == 1
