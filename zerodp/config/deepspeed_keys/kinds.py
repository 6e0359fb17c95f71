"""Dotted key paths into a raw config dict, and the value kinds the tables accept.

The compatibility tables name keys by their dotted path ("zero_optimization.
reduce_scatter") and say what values a key may hold. Keys that zerodp drops
(they change nothing here) are still type-checked, so a DeepSpeed config
that DeepSpeed would reject is rejected here too, with the same message
style as the pydantic models ("config key 'x': got ...; allowed: ...").
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zerodp.config.shown_values import show_value

AUTO = "auto"


def parent_of(data: Mapping[str, Any], path: str) -> tuple[dict[str, Any], str] | None:
    """The dict holding `path`'s last key (and that key), if every step is a dict."""
    *heads, last = path.split(".")
    node: Any = data
    for head in heads:
        node = node.get(head) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None
    return node, last


def has(data: Mapping[str, Any], path: str) -> bool:
    found = parent_of(data, path)
    return found is not None and found[1] in found[0]


def get(data: Mapping[str, Any], path: str) -> Any:
    found = parent_of(data, path)
    if found is None:
        return None
    return found[0].get(found[1])


def put(data: dict[str, Any], path: str, value: Any) -> None:
    """Set `path`, creating the dicts above it (an existing non-dict is left alone)."""
    *heads, last = path.split(".")
    node = data
    for head in heads:
        child = node.setdefault(head, {})
        if not isinstance(child, dict):
            return
        node = child
    node[last] = value


def pop(data: dict[str, Any], path: str) -> Any:
    found = parent_of(data, path)
    if found is None:
        return None
    return found[0].pop(found[1], None)


def show(value: Any) -> str:
    """A value as a JSON author wrote it (true, null, "cpu"), shortened."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, str | dict | list):
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            return show_value(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return show_value(value)


@dataclass(frozen=True)
class Kind:
    """What a key accepts: `allowed` is the text errors show; `fields` for a JSON object."""

    allowed: str
    check: Callable[[Any], bool]
    fields: Mapping[str, Kind] = field(default_factory=dict)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return _number(value) and float(value).is_integer()


BOOL = Kind("true or false", lambda v: isinstance(v, bool))
INT = Kind("an integer", _integer)
NUMBER = Kind("a finite number", _number)
STR = Kind("a string", lambda v: isinstance(v, str))
LIST = Kind("a JSON list", lambda v: isinstance(v, list))
ANY = Kind("any value", lambda v: True)


def nullable(kind: Kind) -> Kind:
    return Kind(f"{kind.allowed} or null", lambda v: v is None or kind.check(v), kind.fields)


def block(**fields: Kind) -> Kind:
    """A JSON object whose keys are `fields` (each checked by its own kind)."""
    return Kind("a JSON object (mapping of keys to values)", lambda v: isinstance(v, dict), fields)


def check_value(path: str, value: Any, kind: Kind) -> list[str]:
    """The problems with `value` at `path`; "auto" passes anywhere (it changes nothing here)."""
    if value == AUTO:
        return []
    if not kind.check(value):
        return [f"config key '{path}': got {show_value(value)}; allowed: {kind.allowed}"]
    if not kind.fields:
        return []
    problems = []
    for key, item in value.items():
        inner = kind.fields.get(key)
        if inner is None:
            problems.append(unknown_key(f"{path}.{key}", kind.fields))
        else:
            problems += check_value(f"{path}.{key}", item, inner)
    return problems


def unknown_key(path: str, known: Mapping[str, Any]) -> str:
    """The message for a key a table's block does not have, worded as the models word it."""
    key = path.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f"unknown config key '{path}'; did you mean '{close[0]}'?"
    return f"unknown config key '{path}'; allowed keys here: {', '.join(sorted(known))}"
