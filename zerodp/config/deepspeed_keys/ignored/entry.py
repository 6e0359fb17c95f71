"""One entry of the table of DeepSpeed keys without effect, and the tests of their values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerodp.config.deepspeed_keys.kinds import Kind


def always(value: Any) -> bool:
    return True


def equals(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def not_enabled(value: Any) -> bool:
    return isinstance(value, dict) and not value.get("enabled", False)


def all_false(value: Any) -> bool:
    return isinstance(value, dict) and not any(
        v for k, v in value.items() if k != "number_checkpoints"
    )


@dataclass(frozen=True)
class Ignored:
    path: str
    kind: Kind
    why: str  # why the key changes nothing in zerodp
    same: Callable[[Any], bool] = always  # the values that ask for what zerodp does anyway
    differs: str = ""  # what to tell a config whose value asks for something else
