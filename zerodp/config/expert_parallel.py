"""`expert_parallel`: DeepSpeed's AutoEP block, read as zerodp's expert parallelism.

`"expert_parallel": {"enabled": true, "autoep_size": E}` splits every
mixture-of-experts layer's experts over E ranks that read different tokens
(docs/expert-parallel.md). Which modules are experts comes from the model:
a Hugging Face MoE model's own expert plan (`config.base_model_ep_plan`), or
for another model zerodp's `plan` (module-name patterns naming each experts
module, `*` standing for one part of a name) or DeepSpeed's
`moe_layer_pattern` (a regular expression over module names) with
`expert_pattern` (the experts module's name inside each match, "experts" by
default). `preset_model` names DeepSpeed's preset; zerodp uses no presets and
checks the name against the model instead. DeepSpeed's knobs of its own
kernels change nothing here and are listed in the config warning; the keys
that would change the model's routing (top_k, score_func, route_norm, ...)
are accepted only at their default ("auto": the model's own), since zerodp
routes exactly as the model does (`zerodp.config.deepspeed_keys`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator

from zerodp.config.errors import SectionRuleError
from zerodp.config.fields import Bool, PosInt, Section, reject

# DeepSpeed 0.19.8's AutoEP presets, and the Hugging Face model types each covers.
PRESET_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "mixtral": ("mixtral",),
    "qwen3_moe": ("qwen3_moe", "qwen2_moe"),
    "qwen3_5_moe": ("qwen3_5_moe",),
    "deepseek_v2": ("deepseek_v2",),
    "deepseek_v3": ("deepseek_v3",),
    "minimax_m3": ("minimax_m3",),
}


def _patterns(value: Any) -> Any:
    """A pattern or a list of them; every one a non-empty string."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(p, str) and p for p in items):
        raise reject(
            "a module-name pattern or a non-empty list of them (e.g. 'model.layers.*.mlp.experts')"
        )
    return list(items)


def _regex(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise reject(r"a regular expression over module names (e.g. 'model\.layers\.\d+\.mlp')")
    try:
        re.compile(value)
    except re.error as caught:
        raise reject(f"a valid regular expression ({caught})") from None
    return value


def _name(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str) or not value or "." in value:
        raise reject("the experts module's attribute name inside each MoE layer (e.g. 'experts')")
    return value


def _preset(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str) or value not in PRESET_MODEL_TYPES:
        raise reject(f"one of DeepSpeed's AutoEP presets: {', '.join(sorted(PRESET_MODEL_TYPES))}")
    return value


Patterns = Annotated[list[str] | None, BeforeValidator(_patterns)]
Regex = Annotated[str | None, BeforeValidator(_regex)]
ChildName = Annotated[str | None, BeforeValidator(_name)]
Preset = Annotated[str | None, BeforeValidator(_preset)]


class ExpertParallelConfig(Section):
    """The `expert_parallel` section (see the module docstring)."""

    enabled: Bool = False
    autoep_size: PosInt = 1
    preset_model: Preset = None
    moe_layer_pattern: Regex = None
    expert_pattern: ChildName = None
    # zerodp's: module-name patterns of the experts modules; replaces the model's own plan.
    plan: Patterns = None

    @property
    def size(self) -> int:
        """E: the ranks each MoE layer's experts are split over (1: no expert parallelism)."""
        return self.autoep_size if self.enabled else 1

    @model_validator(mode="after")
    def _one_way_to_name_the_experts(self) -> ExpertParallelConfig:
        if self.plan is not None and self.moe_layer_pattern is not None:
            raise SectionRuleError(
                ("plan", "moe_layer_pattern"),
                lambda k: (
                    f"config keys '{k[0]}' and '{k[1]}' both name the experts modules; keep "
                    f"one ('{k[0]}': module-name patterns of the experts modules)"
                ),
            )
        if self.expert_pattern is not None and self.moe_layer_pattern is None:
            if self.preset_model is not None:
                raise SectionRuleError(
                    ("expert_pattern", "preset_model"),
                    lambda k: (
                        f"config key '{k[0]}' renames the experts module of DeepSpeed's preset "
                        f"'{k[1]}'; zerodp uses no presets and finds the experts by the model's "
                        f"own expert plan: remove '{k[0]}' (or name the experts modules with "
                        "'plan')"
                    ),
                )
            raise SectionRuleError(
                ("expert_pattern", "moe_layer_pattern"),
                lambda k: (
                    f"config key '{k[0]}' names the experts module inside each MoE layer, "
                    f"but '{k[1]}' (which modules are MoE layers) is not given: add it, or "
                    f"remove '{k[0]}'"
                ),
            )
        return self

    def experts_modules(self, names: list[str]) -> list[str] | None:
        """The experts modules DeepSpeed's `moe_layer_pattern` / `expert_pattern` name among a
        model's module `names` (None: that form is not used)."""
        if self.moe_layer_pattern is None:
            return None
        layer = re.compile(self.moe_layer_pattern)
        child = self.expert_pattern or "experts"
        wanted = {f"{n}.{child}" for n in names if layer.fullmatch(n)}
        return [n for n in names if n in wanted]
