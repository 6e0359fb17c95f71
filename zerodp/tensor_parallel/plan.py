"""Which modules a model splits, and how: its plan, read and matched against its module names.

A plan maps module-name patterns to a style. Patterns are dotted names in
which `*` stands for exactly one part (`layers.*.mlp.up_proj` matches
`layers.0.mlp.up_proj`, not `layers.0.1.mlp.up_proj`), as in Hugging Face's
plans. Where a plan comes from:

1. `tensor_parallel.plan` in the config, when given: it replaces the model's own;
   every pattern must match at least one module (a typo is an error).
2. A Hugging Face model's own: the plan its instance carries (`model.tp_plan`,
   which the pinned transformers merges from `config.base_model_tp_plan`, the
   class's `_tp_plan` and the vocabulary-parallel input embedding), else the
   config's `base_model_tp_plan` under the base model's prefix plus the class's
   `_tp_plan`. Patterns that match nothing are skipped (a plan is written for
   every size of an architecture).

Styles zerodp implements: "colwise", "rowwise", "colwise_gather_output" (HF's
older "colwise_rep"), "embedding_rowwise". A module that a plan gives another
style (HF's "rowwise_split_input", "replicated_with_grad_allreduce", expert
styles, ...) is refused with its name and style: zerodp never leaves a module
whole that the plan meant to split.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from zerodp.config.tensor_parallel import (
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    EMBEDDING_ROWWISE,
    ROWWISE,
    STYLE_ALIASES,
)
from zerodp.errors import ConfigError


class Style(enum.Enum):
    """How a module is split (the plan's words)."""

    COLWISE = COLWISE
    ROWWISE = ROWWISE
    COLWISE_GATHER_OUTPUT = COLWISE_GATHER_OUTPUT
    EMBEDDING_ROWWISE = EMBEDDING_ROWWISE

    @property
    def split_dim(self) -> int:
        """The weight dimension this style splits: output features / rows (0) or inputs (1)."""
        return 1 if self is Style.ROWWISE else 0


class PlanSource(enum.Enum):
    CONFIG = "tensor_parallel.plan"
    MODEL = "the model's own plan"


@dataclass(frozen=True)
class Plan:
    """Patterns to styles (a style zerodp lacks is kept as its name, to refuse it by module)."""

    entries: dict[str, Style | str]
    source: PlanSource

    def style_of(self, module_name: str) -> tuple[str, Style | str] | None:
        """The pattern that names `module_name` and its style; None: left whole.

        Raises `ConfigError` when two patterns name the module with different styles.
        """
        found = [(p, s) for p, s in self.entries.items() if matches(p, module_name)]
        styles = {s for _, s in found}
        if len(styles) > 1:
            shown = ", ".join(f"{p!r}: {_shown(s)}" for p, s in found)
            raise ConfigError(
                f"{self.source.value} names module '{module_name}' twice with different styles "
                f"({shown}); keep one pattern for it"
            )
        return found[0] if found else None


def _shown(style: Style | str) -> str:
    return repr(style.value if isinstance(style, Style) else style)


def matches(pattern: str, module_name: str) -> bool:
    """Whether `pattern` names `module_name` ('*' stands for exactly one dotted part)."""
    parts, names = pattern.split("."), module_name.split(".")
    return len(parts) == len(names) and all(
        p in ("*", n) for p, n in zip(parts, names, strict=True)
    )


def _as_style(style: str) -> Style | str:
    canonical = STYLE_ALIASES.get(style, style)
    try:
        return Style(canonical)
    except ValueError:
        return style


def read_plan(model: nn.Module, configured: Mapping[str, str] | None) -> Plan:
    """The plan `model` is split by: the configured one, else the model's own.

    Raises `ConfigError` when there is none (a model without a plan needs
    `tensor_parallel.plan`).
    """
    if configured:
        return Plan({p: _as_style(s) for p, s in configured.items()}, PlanSource.CONFIG)
    own = huggingface_plan(model)
    if not own:
        raise ConfigError(
            f"tensor_parallel.autotp_size > 1, but {type(model).__name__} has no tensor-parallel "
            "plan of its own (a Hugging Face model's config.base_model_tp_plan): give "
            'tensor_parallel.plan, module-name patterns to "colwise" / "rowwise", e.g. '
            '{"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"} (docs/tensor-parallel.md)'
        )
    return Plan({p: _as_style(s) for p, s in own.items()}, PlanSource.MODEL)


def huggingface_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face model's plan, with names relative to `model` (empty: none)."""
    instance = model.__dict__.get("_tp_plan")
    if isinstance(instance, dict) and instance:
        return {str(k): str(v) for k, v in instance.items()}
    plan: dict[str, str] = {}
    config: Any = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = getattr(model, "base_model_prefix", "")
        under = (
            f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        )
        plan.update({f"{under}{k}": str(v) for k, v in base.items()})
    own = getattr(type(model), "_tp_plan", None)
    if isinstance(own, dict):
        plan.update({str(k): str(v) for k, v in own.items()})
    return plan
