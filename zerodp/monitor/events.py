"""Scalar training events, `(name, value, step)`, and the names zerodp reports under.

An event is a plain tuple so that callers (the engine, user code) need not
import anything to produce one; `Event` is a NamedTuple of the same shape for
readability. Names follow DeepSpeed's "Train/Samples/<quantity>" layout so
dashboards and scripts written for DeepSpeed's monitors read zerodp's output
without changes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import NamedTuple

TRAIN_LOSS = "Train/Samples/train_loss"
LEARNING_RATE = "Train/Samples/lr"
GRAD_NORM = "Train/Samples/grad_norm"
LOSS_SCALE = "Train/Samples/loss_scale"
SAMPLES_PER_SEC = "Train/Samples/samples_per_sec"
NON_FINITE_STEPS = "Train/Samples/non_finite_steps"  # steps with an inf/NaN gradient norm
EIGENVALUE_PREFIX = "Train/Eigenvalues/"


class Event(NamedTuple):
    """One scalar at one step; any `(str, float, int)` tuple is accepted where an Event is."""

    name: str
    value: float
    step: int


def eigenvalue_event_name(block: int | str) -> str:
    """The event name for the top Hessian eigenvalue of one model block."""
    return f"{EIGENVALUE_PREFIX}{block}"


def as_event(item: object) -> Event:
    """Check one `(name, value, step)` item and normalise it to an Event.

    Validation happens here, before any sink writes, so a malformed event is
    reported with its content instead of as a half-written CSV row. Values
    that are 0-d tensors or numpy scalars are accepted (anything with
    `__float__`); NaN and infinities are kept, since a diverging loss is
    exactly what a monitor must show.
    """
    if not isinstance(item, tuple) or len(item) != 3:
        raise TypeError(f"a monitor event is a (name, value, step) tuple, got {item!r}")
    name, value, step = item
    if not isinstance(name, str) or not name:
        raise TypeError(f"a monitor event name must be a non-empty str, got {name!r}")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"the step of monitor event {name!r} must be an int, got {step!r}")
    if isinstance(value, (bool, str, bytes)):
        number = None
    else:
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            number = None
    if number is None:
        raise TypeError(
            f"the value of monitor event {name!r} must be a number (float, int, 0-d tensor), "
            f"got {value!r}"
        )
    return Event(name, number, int(step))


def as_events(items: Iterable[object]) -> list[Event]:
    """Validate a batch of events (all of them, before anything is written)."""
    if isinstance(items, tuple) and len(items) == 3 and isinstance(items[0], str):
        raise TypeError(
            "write_events takes a list of (name, value, step) tuples; wrap a single event "
            "in a list: write_events([(name, value, step)])"
        )
    return [as_event(item) for item in items]
