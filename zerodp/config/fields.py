"""The building blocks of every config section: strict scalar types and `Section`.

Scalar fields use the small validators below instead of pydantic's lax
coercion, because lax mode would turn `"false"` into `False` and `true` into
`1`; a JSON author who wrote the wrong type should hear about it. Integral
floats are the one coercion kept, since JSON authors write sizes as `5e8`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from zerodp.config.errors import SectionRuleError, to_config_error
from zerodp.errors import ConfigError


def or_list(options: Sequence[object]) -> str:
    shown = [repr(o) for o in options]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def reject(allowed: str) -> PydanticCustomError:
    return PydanticCustomError("zerodp_value", "allowed: {allowed}", {"allowed": allowed})


def int_check(lo: int | None = None, choices: tuple[int, ...] | None = None) -> BeforeValidator:
    if choices is not None:
        allowed = or_list(choices)
    else:
        allowed = "an integer" if lo is None else f"an integer >= {lo}"

    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise reject(allowed)
        if isinstance(value, float) and not value.is_integer():
            raise reject(allowed)
        number = int(value)
        if (lo is not None and number < lo) or (choices is not None and number not in choices):
            raise reject(allowed)
        return number

    return BeforeValidator(check)


def parallel_size(value: object, key: str) -> int:
    """A parallel dimension's size read from a raw config dict before the config is parsed
    (an integration sizes its loaders first): 1 when absent, else `PosInt`'s check, its
    rejection a `ConfigError` naming the key, never a size quietly taken as 1."""
    if value is None:
        return 1
    try:
        number: int = _POSITIVE.func(value)  # type: ignore[call-arg]
    except PydanticCustomError as caught:
        raise ConfigError(f"config key '{key}': got {value!r}; {caught}") from None
    return number


def float_check(
    *,
    ge: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> BeforeValidator:
    if ge is not None and lt is not None:
        allowed = f"a number in [{ge:g}, {lt:g})"
    elif ge is not None and le is not None:
        allowed = f"a number in [{ge:g}, {le:g}]"
    elif ge is not None:
        allowed = f"a number >= {ge:g}"
    elif gt is not None:
        allowed = f"a number > {gt:g}"
    else:
        allowed = "a finite number"

    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise reject(allowed)
        number = float(value)
        if not math.isfinite(number):
            raise reject(allowed)
        if (
            (ge is not None and number < ge)
            or (gt is not None and number <= gt)
            or (lt is not None and number >= lt)
            or (le is not None and number > le)
        ):
            raise reject(allowed)
        return number

    return BeforeValidator(check)


def exact(kind: type, allowed: str) -> BeforeValidator:
    def check(value: object) -> object:
        if type(value) is not kind:
            raise reject(allowed)
        return value

    return BeforeValidator(check)


def choice(options: Sequence[str]) -> BeforeValidator:
    """Match case-insensitively and store the canonical spelling."""
    canonical = {o.lower(): o for o in options}
    allowed = or_list(options)

    def check(value: object) -> str:
        if not isinstance(value, str) or value.lower() not in canonical:
            raise reject(allowed)
        return canonical[value.lower()]

    return BeforeValidator(check)


_POSITIVE = int_check(lo=1)
PosInt = Annotated[int, _POSITIVE]
NonNegInt = Annotated[int, int_check(lo=0)]
PosFloat = Annotated[float, float_check(gt=0.0)]
Fraction = Annotated[float, float_check(ge=0.0, le=1.0)]
NonNegFloat = Annotated[float, float_check(ge=0.0)]
UnitFloat = Annotated[float, float_check(ge=0.0, lt=1.0)]
Bool = Annotated[bool, exact(bool, "true or false")]
Str = Annotated[str, exact(str, "a string")]
OptStr = Str | None
LastIteration = Annotated[int, int_check(lo=-1)]
WarmupType = Annotated[Literal["log", "linear"], choice(("log", "linear"))]


def _betas(value: object) -> tuple[float, float]:
    allowed = "a list of two numbers in [0, 1), e.g. [0.9, 0.999]"
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise reject(allowed)
    out: list[float] = []
    for beta in value:
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta < 1.0:
            raise reject(allowed)
        out.append(float(beta))
    return (out[0], out[1])


Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]


def _str_list(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise reject("a list of strings")
    return tuple(value)


StrList = Annotated[tuple[str, ...], BeforeValidator(_str_list)]


_S = TypeVar("_S", bound="Section")


class Section(BaseModel):
    """Base of every config section: frozen, closed to unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def from_dict(cls: type[_S], data: Mapping[str, Any]) -> _S:
        """Validate `data`, raising `ConfigError` (key paths relative to this section)."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise to_config_error(exc, cls) from None


def must_exceed(bigger: str, smaller: str, big: int, small: int) -> SectionRuleError:
    return SectionRuleError(
        (bigger, smaller),
        lambda k: (
            f"config key '{k[0]}': got {big}; allowed: an integer > '{k[1]}' ({small}); "
            f"raise '{k[0]}' or lower '{k[1]}'"
        ),
    )
