"""Which modules of a model are its experts modules, and which of their tensors are experts-first.

An experts module holds the experts of one MoE layer as fused tensors whose
first dimension is the expert (transformers 5.x: `gate_up_proj` [N, ...],
`down_proj` [N, ...], gpt-oss's biases [N, ...]); the router and any shared
experts are other modules. Its forward takes the router's choice,
`(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`.
Where the plan comes from:

1. Module-name patterns (`expert_parallel.plan`), when given: each
   names experts modules (dotted names, `*` standing for exactly one part, as in
   tensor parallelism's plans); every pattern must match at least one module, and
   every parameter a matched module holds directly is an expert tensor.
2. A Hugging Face model's own plan (`base_model_ep_plan` in its config, which the
   model instance carries merged under its base model's prefix): modules styled
   "ep_dispatch_experts" are experts modules, parameters styled "grouped_gemm"
   their expert tensors, and parameters styled "replicated_with_grad_allreduce"
   stay whole. Patterns that match nothing are skipped (a plan is written for every
   variant of an architecture: DeepSeek-V3's first dense layers have no experts),
   but a plan that matches no module at all is an error.

The number of experts N is read from the module (`num_experts`, else
`num_local_experts` or `n_routed_experts`) and every expert tensor's first
dimension must equal it. `find_experts` checks everything it can and raises one
`ConfigError` listing every problem; it changes nothing.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from zerodp.errors import ConfigError
from zerodp.tensor_parallel.plan import matches

EXPERTS_STYLE = "ep_dispatch_experts"  # a module holding the experts of one layer
EXPERT_TENSOR_STYLE = "grouped_gemm"  # one of its experts-first fused tensors
WHOLE_STYLE = "replicated_with_grad_allreduce"  # a parameter every rank keeps whole
PATTERN_KEY = "expert_parallel.plan"
# Attributes in which an experts module keeps its number of experts, in the order asked.
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts")


class PlanSource(enum.Enum):
    CONFIG = PATTERN_KEY
    MODEL = "the model's own expert plan (config.base_model_ep_plan)"


@dataclass(frozen=True)
class ExpertPlan:
    """Patterns naming experts modules, and (a model's own plan) patterns naming their tensors.

    `tensors` None: every parameter an experts module holds directly is an expert tensor.
    """

    modules: tuple[str, ...]
    tensors: tuple[str, ...] | None
    source: PlanSource


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module found by a plan: its name, N, where N is kept, its expert tensors."""

    name: str
    module: nn.Module
    num_experts: int
    count_attribute: str
    tensors: tuple[str, ...]  # attribute names of its experts-first parameters


def read_plan(model: nn.Module, patterns: Sequence[str] | str | None) -> ExpertPlan:
    """The plan `model`'s experts are found by: the given patterns, else the model's own.

    Raises `ConfigError` when there is neither, naming the fix.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if patterns:
        bad = [p for p in patterns if not isinstance(p, str) or not p]
        if bad:
            raise ConfigError(f"{PATTERN_KEY}: {bad!r} are not module-name patterns")
        return ExpertPlan(tuple(patterns), None, PlanSource.CONFIG)
    own = huggingface_ep_plan(model)
    modules = tuple(p for p, style in own.items() if style == EXPERTS_STYLE)
    if not modules:
        raise ConfigError(
            f"expert parallelism is on, but {type(model).__name__} has no expert plan of its own "
            "(a Hugging Face MoE model's config.base_model_ep_plan): give "
            f"{PATTERN_KEY}, the names of its experts modules with '*' for one part, e.g. "
            '["model.layers.*.mlp.experts"]; each must hold the experts of a layer as '
            "experts-first tensors (docs/expert-parallel.md)"
        )
    known = (EXPERTS_STYLE, EXPERT_TENSOR_STYLE, WHOLE_STYLE)
    unknown = {p: s for p, s in own.items() if s not in known}
    if unknown:
        raise ConfigError(
            f"{PlanSource.MODEL.value} of {type(model).__name__} gives styles zerodp does not "
            f"implement: {unknown}; zerodp splits {EXPERTS_STYLE!r} modules and their "
            f"{EXPERT_TENSOR_STYLE!r} tensors: give {PATTERN_KEY} instead"
        )
    tensors = tuple(p for p, style in own.items() if style == EXPERT_TENSOR_STYLE)
    return ExpertPlan(modules, tensors, PlanSource.MODEL)


def huggingface_ep_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face model's expert plan, with names relative to `model` (empty: none).

    The instance's own (`_ep_plan`, merged by transformers from its config under the base
    model's prefix), else the config's `base_model_ep_plan` under `base_model_prefix`.
    """
    instance = model.__dict__.get("_ep_plan")
    if isinstance(instance, dict) and instance:
        return {str(k): str(v) for k, v in instance.items()}
    config: Any = getattr(model, "config", None)
    base = getattr(config, "base_model_ep_plan", None)
    if not isinstance(base, dict) or not base:
        return {}
    prefix = getattr(model, "base_model_prefix", "")
    under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {f"{under}{k}": str(v) for k, v in base.items()}


def find_experts(model: nn.Module, plan: ExpertPlan) -> list[ExpertsModule]:
    """The experts modules `plan` names in `model`, in model order, every check passed.

    Raises `ConfigError` listing every problem (see the module docstring).
    """
    problems: list[str] = []
    found: list[tuple[str, nn.Module]] = []
    used: set[str] = set()
    for name, module in model.named_modules():
        hits = [p for p in plan.modules if name and matches(p, name)]
        if hits:
            used.update(hits)
            found.append((name, module))
    problems += _unmatched(model, plan, used, found)
    problems += _nested(found)
    experts = []
    for name, module in found:
        tensors = _expert_tensors(name, module, plan)
        module_problems = _module_problems(name, module, tensors)
        problems += module_problems
        if not module_problems:
            count, attribute = _expert_count(module)
            experts.append(ExpertsModule(name, module, count, attribute, tensors))
    if plan.tensors is not None:
        problems += _stray_tensors(model, plan, {n for n, _ in found})
    if problems:
        raise ConfigError(
            f"{plan.source.value} cannot split the experts of {type(model).__name__}: "
            + "; ".join(problems)
        )
    return experts


def _unmatched(
    model: nn.Module, plan: ExpertPlan, used: set[str], found: list[tuple[str, nn.Module]]
) -> list[str]:
    if plan.source is PlanSource.CONFIG:
        unmatched = [p for p in plan.modules if p not in used]
        if unmatched:
            return [
                f"{', '.join(repr(p) for p in unmatched)} match no module of "
                f"{type(model).__name__}; patterns are module names as named_modules() gives "
                "them, '*' standing for one part (e.g. 'model.layers.*.mlp.experts')"
            ]
        return []
    if not found:
        shown = ", ".join(repr(p) for p in plan.modules)
        return [
            f"its experts patterns ({shown}) match none of its modules (a wrapped model names "
            f"its modules differently): give {PATTERN_KEY} with patterns of its named_modules()"
        ]
    return []


def _nested(found: list[tuple[str, nn.Module]]) -> list[str]:
    names = [n for n, _ in found]
    return [
        f"'{inner}' is inside '{outer}': name experts modules that do not hold one another"
        for outer in names
        for inner in names
        if inner.startswith(outer + ".")
    ]


def _expert_tensors(name: str, module: nn.Module, plan: ExpertPlan) -> tuple[str, ...]:
    own = [a for a, p in module._parameters.items() if p is not None]
    if plan.tensors is None:
        return tuple(own)
    return tuple(a for a in own if any(matches(p, f"{name}.{a}") for p in plan.tensors))


def _expert_count(module: nn.Module) -> tuple[int, str]:
    for attribute in EXPERT_COUNT_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, attribute
    return -1, ""


def _module_problems(name: str, module: nn.Module, tensors: tuple[str, ...]) -> list[str]:
    if getattr(module, "expert_group", None) is not None:
        return [f"'{name}' is split already (zerodp's expert parallelism); split a whole model"]
    if getattr(module, "_is_expert_parallel", False):
        return [
            f"'{name}' was already split by transformers' own expert parallelism "
            "(from_pretrained(distributed_config=...)): load the model whole and let zerodp "
            "split it"
        ]
    if "forward" in module.__dict__:
        return [
            f"'{name}' has a forward set on the instance (accelerate's hooks from a "
            "device_map or an offload, or another wrapper), which zerodp's dispatch would "
            "bypass: load the model without device_map and without hooks on its experts"
        ]
    count, _ = _expert_count(module)
    if count < 1:
        return [
            f"'{name}' ({type(module).__name__}) keeps no number of experts: give it an int "
            f"attribute {EXPERT_COUNT_ATTRIBUTES[0]!r} (its forward must read it, as Hugging "
            "Face's experts modules do)"
        ]
    if not tensors:
        return [f"'{name}' holds no expert tensor (experts-first parameters) of its own"]
    problems = _signature_problems(name, module)
    for attribute in tensors:
        shape = tuple(module._parameters[attribute].shape)  # type: ignore[union-attr]
        if not shape or shape[0] != count:
            problems.append(
                f"'{name}.{attribute}' has shape {shape}, not experts-first with "
                f"{name}.{_expert_count(module)[1]} = {count} experts"
            )
    return problems


def _signature_problems(name: str, module: nn.Module) -> list[str]:
    """The forward must take (hidden_states, top_k_index, top_k_weights), as HF's experts do."""
    parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(parameters) != 3 or any(p.kind not in positional for p in parameters):
        shown = ", ".join(p.name for p in parameters)
        return [
            f"'{name}' ({type(module).__name__}) has forward({shown}); an experts module's "
            "forward takes (hidden_states, top_k_index, top_k_weights), the router's choice"
        ]
    return []


def _stray_tensors(model: nn.Module, plan: ExpertPlan, experts: set[str]) -> list[str]:
    """Parameters the plan calls expert tensors that no experts module holds."""
    tensors = plan.tensors or ()
    stray = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in experts and any(matches(p, name) for p in tensors):
            stray.append(name)
    if not stray:
        return []
    return [
        f"{', '.join(repr(n) for n in stray[:4])} are expert tensors in the plan but not held "
        f"by a module it styles {EXPERTS_STYLE!r}"
    ]
