"""Import paths zerodp used to have, and what they do now.

Modules moved out of the package root (it holds at most six modules) and some were renamed
to say what they hold. An old path of a public helper keeps working, with a
`DeprecationWarning` naming the new one; an old path of an internal module raises
`ImportError` naming the new one. `zerodp/__init__.py` installs the finder;
`MOVED` is the whole list, and [Note: retiring old paths] says when each is dropped.
"""

from zerodp.old_paths.finder import (
    MOVED,
    REMOVED_IN,
    Moved,
    OldPathFinder,
    install,
    moved_from,
    root_attribute,
)

__all__ = [
    "MOVED",
    "REMOVED_IN",
    "Moved",
    "OldPathFinder",
    "install",
    "moved_from",
    "root_attribute",
]
