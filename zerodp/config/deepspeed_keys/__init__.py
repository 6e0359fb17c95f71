"""DeepSpeed compatibility: turn a DeepSpeed config into one zerodp's models validate.

`translate` runs before validation and does three things, in order:

1. rewrites older and alternative key names to the canonical ones (aliases);
2. drops the keys that change nothing in zerodp, after checking their types,
   and notes each one (with a louder note when its value asks for something
   zerodp does not do) for the one config warning;
3. reports every key asking for a feature zerodp does not implement, with
   what to do instead; a feature left off (`"enabled": false`) is accepted
   and noted.

Problems are collected, not raised, so the caller can report them together
with any other problem in one message. Everything here is pure and works on
a copy the caller owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerodp.config.deepspeed_keys.aliases import (
    ALIAS_PATHS,
    OPTIMIZER_TYPES,
    RENAMES,
    apply_aliases,
)
from zerodp.config.deepspeed_keys.ignored import IGNORED, Ignored
from zerodp.config.deepspeed_keys.kinds import check_value, get, has, pop, show
from zerodp.config.deepspeed_keys.unsupported import (
    UNSUPPORTED,
    UNSUPPORTED_OPTIMIZERS,
    UNSUPPORTED_SCHEDULERS,
    Unsupported,
)

__all__ = [
    "ALIAS_PATHS",
    "IGNORED",
    "OPTIMIZER_TYPES",
    "RENAMES",
    "UNSUPPORTED",
    "Notice",
    "Translation",
    "format_notice",
    "known_keys",
    "translate",
]


@dataclass(frozen=True)
class Notice:
    """One key accepted without effect: why, and whether its value asks for more."""

    path: str
    text: str
    differs: bool = False


@dataclass(frozen=True)
class Translation:
    data: dict[str, Any]
    notices: tuple[Notice, ...]
    problems: tuple[str, ...]


def translate(data: dict[str, Any]) -> Translation:
    """Rewrite `data` (in place, and returned) into zerodp's keys; see the module docstring."""
    written, problems = apply_aliases(data)
    notices: list[Notice] = []
    for entry in UNSUPPORTED:
        _unsupported(data, entry, written, notices, problems)
    _unsupported_types(data, problems)
    for ignored in IGNORED:
        _ignored(data, ignored, notices, problems)
    return Translation(data, tuple(notices), tuple(problems))


def _ignored(
    data: dict[str, Any], entry: Ignored, notices: list[Notice], problems: list[str]
) -> None:
    if not has(data, entry.path):
        return
    value = pop(data, entry.path)
    found = check_value(entry.path, value, entry.kind)
    if found:
        problems.extend(found)
    elif value == "auto" or entry.same(value):
        notices.append(Notice(entry.path, entry.why))
    else:
        notices.append(Notice(entry.path, f"= {show(value)}: {entry.differs}", differs=True))


def _unsupported(
    data: dict[str, Any],
    entry: Unsupported,
    written: dict[str, str],
    notices: list[Notice],
    problems: list[str],
) -> None:
    if not has(data, entry.path):
        return
    value = get(data, entry.path)
    if entry.off(value):
        if not entry.schema_key:
            pop(data, entry.path)
            notices.append(Notice(entry.path, entry.off_note()))
        return
    if not entry.schema_key:
        pop(data, entry.path)  # reported here; later steps must not trip over it again
    origin = written.get(entry.path)
    shown = f"'{entry.path}' = {show(value)}" + (f", from '{origin}'" if origin else "")
    problems.append(f"zerodp does not implement {entry.feature} ({shown}); {entry.instead}")


def _unsupported_types(data: dict[str, Any], problems: list[str]) -> None:
    for section, table in (
        ("optimizer", UNSUPPORTED_OPTIMIZERS),
        ("scheduler", UNSUPPORTED_SCHEDULERS),
    ):
        kind = get(data, f"{section}.type")
        if isinstance(kind, str) and kind.lower() in table:
            feature, instead = table[kind.lower()]
            problems.append(
                f"zerodp does not implement {feature} ('{section}.type' = {show(kind)}); {instead}"
            )


def known_keys(section: str) -> frozenset[str]:
    """Key names the tables know inside `section` ("" is the top level): for "did you mean"."""
    paths = [e.path for e in IGNORED] + [e.path for e in UNSUPPORTED] + list(ALIAS_PATHS)
    prefix = f"{section}." if section else ""
    names = set()
    for path in paths:
        if path.startswith(prefix):
            rest = path[len(prefix) :]
            names.add(rest.split(".", 1)[0])
    return frozenset(names)


def format_notice(notices: tuple[Notice, ...] | list[Notice]) -> str:
    """The one config warning: the keys whose value asks for more first, then the rest.

    Keys with the same reason share a line, so the warning stays short.
    """
    count = len(notices)
    noun = "key has" if count == 1 else "keys have"
    lines = [f"zerodp: {count} DeepSpeed config {noun} no effect here (see docs/configuration.md):"]
    lines += [f"  - {n.path} {n.text}" for n in notices if n.differs]
    grouped: dict[str, list[str]] = {}
    for notice in notices:
        if not notice.differs:
            grouped.setdefault(notice.text, []).append(notice.path)
    lines += [f"  - {', '.join(paths)}: {text}" for text, paths in grouped.items()]
    return "\n".join(lines)
