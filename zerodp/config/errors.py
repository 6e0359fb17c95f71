"""Turn pydantic's validation errors into one `ConfigError` a user can act on.

Pydantic reports errors as locations and type codes. A user editing a JSON file
needs the dotted key path, the value they wrote, what would have been
accepted, and (for a misspelled key) the spelling we think they meant. Every
message starts with the full key path so several errors read as a checklist.

Two exception types let validators inside the models report errors that
pydantic cannot express with a field location:

* `SectionRuleError` for a rule across several keys of one section (e.g.
  `total_num_steps` must exceed `warmup_num_steps`); its message is rendered
  with the section's full path once the location is known.
* `NestedSectionError` for a free-form `params` dict validated by a model that
  depends on a sibling key (the optimizer or scheduler `type`); it carries that
  model's own errors so they are reported with full paths, too.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from zerodp.config.deepspeed_keys import known_keys
from zerodp.config.shown_values import show_value
from zerodp.errors import ConfigError

Loc = tuple[int | str, ...]

# What to say is allowed for pydantic's own type errors (ours carry `allowed` in ctx).
_PYDANTIC_ALLOWED = {
    "model_type": "a JSON object (mapping of keys to values)",
    "model_attributes_type": "a JSON object (mapping of keys to values)",
    "dict_type": "a JSON object (mapping of keys to values)",
    "literal_error": None,  # filled from ctx["expected"]
}


class SectionRuleError(ValueError):
    """A rule across several keys of one section failed.

    `keys` are relative to the section the validator runs on; `render` gets
    them back as full dotted paths and builds the message.
    """

    def __init__(self, keys: Sequence[str], render: Callable[[tuple[str, ...]], str]) -> None:
        self.keys = tuple(keys)
        self._render = render
        super().__init__(render(self.keys))

    def message(self, prefix: Loc) -> str:
        return self._render(tuple(join_path((*prefix, key)) for key in self.keys))


class NestedSectionError(ValueError):
    """Errors from validating a `params` dict with the model its `type` selects."""

    def __init__(self, model: type[BaseModel], errors: list[Any], at: Loc) -> None:
        self.model = model
        self.errors = errors
        self.at = at
        super().__init__(f"invalid {at!r} for {model.__name__}")


def join_path(loc: Loc) -> str:
    """Render a pydantic location as the dotted key path a JSON author would write."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def to_config_error(exc: ValidationError, model: type[BaseModel]) -> ConfigError:
    """One `ConfigError` listing every problem pydantic found, one per line."""
    return ConfigError("\n".join(_messages(exc.errors(), model, ())))


def _messages(errors: list[Any], model: type[BaseModel], prefix: Loc) -> list[str]:
    out: list[str] = []
    for err in errors:
        loc: Loc = (*prefix, *err["loc"])
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, NestedSectionError):
            # The nested model's locations are relative to the params dict.
            out.extend(_messages(cause.errors, cause.model, (*loc, *cause.at)))
        elif isinstance(cause, SectionRuleError):
            out.append(cause.message(loc))
        elif isinstance(cause, ConfigError):
            out.append(str(cause))  # already rendered, e.g. by ZeroDPConfig.__init__
        elif err["type"] == "extra_forbidden":
            out.append(_unknown_key(loc, _section_at(model, err["loc"][:-1])))
        elif err["type"] == "missing":
            out.append(_missing_key(loc, model, tuple(err["loc"])))
        else:
            out.append(_bad_value(loc, err))
    return out


def _unknown_key(loc: Loc, section: type[BaseModel] | None) -> str:
    key = str(loc[-1])
    head = f"unknown config key '{join_path(loc)}'"
    allowed = sorted(section.model_fields) if section is not None else []
    if not allowed:
        return f"{head}; remove it"
    # A typo of a DeepSpeed key zerodp accepts (without effect) is still a typo of that key.
    candidates = sorted(set(allowed) | known_keys(join_path(loc[:-1])))
    close = difflib.get_close_matches(key, candidates, n=1)
    if close:
        return f"{head}; did you mean '{close[0]}'?"
    return f"{head}; allowed keys here: {', '.join(allowed)}"


def _missing_key(loc: Loc, model: type[BaseModel], rel_loc: Loc) -> str:
    msg = f"missing required config key '{join_path(loc)}'; add it"
    section = _section_at(model, rel_loc[:-1])
    if section is not None:
        field = section.model_fields.get(str(rel_loc[-1]))
        if field is not None and field.description:
            msg += f" ({field.description})"
    return msg


def _bad_value(loc: Loc, err: Any) -> str:
    path = join_path(loc)
    where = f"config key '{path}'" if path else "the config"
    ctx = err.get("ctx") or {}
    allowed = ctx.get("allowed")
    if allowed is None and err["type"] == "literal_error":
        allowed = ctx.get("expected")
    if allowed is None:
        allowed = _PYDANTIC_ALLOWED.get(err["type"])
    shown = show_value(err.get("input"))
    if allowed is None:
        return f"{where}: got {shown}; {err['msg']}"
    return f"{where}: got {shown}; allowed: {allowed}"


def _section_at(model: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class that validates the object at `loc`, if it is one of ours."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = _model_in(field.annotation)
    return current


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
