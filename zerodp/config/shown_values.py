"""A config value as an error message shows it: short enough that one huge dict cannot flood it.

Its own module because both the messages of `zerodp.config.errors` and the DeepSpeed key
tables of `zerodp.config.deepspeed_keys` show values, and the errors read those tables (for
"did you mean"): the tables must not import the errors back.
"""

from __future__ import annotations

MAX_SHOWN = 80  # characters of a value's repr in a message


def show_value(value: object) -> str:
    """`repr` of the offending value, shortened to `MAX_SHOWN` characters."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
