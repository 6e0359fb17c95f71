"""Splitting a model by its plan, and the record of what was split (`TensorSplit`).

`plan_split` checks everything before anything changes (every rank checks
the same model and the same plan, so every rank raises the same `ConfigError`):

- each module the plan names is a plain `nn.Linear` (the linear styles) or
  `nn.Embedding` ("embedding_rowwise"; without `max_norm`, `sparse` or
  `scale_grad_by_freq`), and the dimension its style splits divides by T;
- a parameter several modules share (tied input and output embeddings) is
  split the same way by each of them, or by none: a tied `lm_head` is split
  only together with the embedding it shares a weight with, never left as a
  whole copy beside a split one;
- attention heads: the model's `num_attention_heads` and
  `num_key_value_heads` divide by T (grouped-query attention with fewer key /
  value heads than T is refused: zerodp does not replicate heads), and the
  head counts a split module's parent keeps as attributes become the local
  ones (num_heads / T).

Then each named module's parameters become this rank's slice (the same
`nn.Parameter` objects; see `zerodp.tensor_parallel.layers`) and the module
its parallel class. The model must be whole and the same on every rank before
(the caller takes it from rank 0), so the slices are those of one model:
`plan_split` checks, `SplitPlan.apply` splits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from zerodp.errors import ConfigError
from zerodp.tensor_parallel.communication import TensorGroup, gather_whole
from zerodp.tensor_parallel.layers import (
    make_column_parallel,
    make_row_parallel,
    make_vocab_parallel,
)
from zerodp.tensor_parallel.plan import Plan, PlanSource, Style

# Attributes in which attention modules keep head counts; a split module's parent that has
# one (an int) gets its local count.
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
_LINEAR_STYLES = (Style.COLWISE, Style.ROWWISE, Style.COLWISE_GATHER_OUTPUT)


@dataclass(frozen=True)
class SplitParam:
    """One split parameter: the weight dimension split, and its whole shape."""

    name: str  # its first name in the model
    dim: int
    full_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Target:
    name: str
    module: nn.Module
    style: Style


class TensorSplit:
    """What `SplitPlan.apply` did: which parameters are slices, along which dimension.

    Asked by the engine (which groups hold slices, the norm's two classes), by
    checkpoints (the slices' layout) and by export (`whole_value`: a slice
    gathered back into the whole tensor, a collective over the tensor group).
    """

    def __init__(
        self, group: TensorGroup, params: dict[nn.Parameter, SplitParam], layers: dict[str, Style]
    ) -> None:
        self.group = group
        self._params = params
        self.layers = layers  # module name -> style, in model order

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def split_of(self, param: Any) -> SplitParam | None:
        """How `param` is split (None: the plan leaves it whole)."""
        if not isinstance(param, nn.Parameter):
            return None
        return self._params.get(param)

    def is_split(self, param: Any) -> bool:
        return self.split_of(param) is not None

    @property
    def split_params(self) -> dict[nn.Parameter, SplitParam]:
        return dict(self._params)

    def names(self, module: nn.Module) -> dict[str, SplitParam]:
        """Every name (tied ones too) of a split parameter of `module`."""
        out = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            found = self.split_of(param)
            if found is not None:
                out[name] = found
        return out

    def whole_value(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which `local` is this rank's slice of `param` (a collective
        over the tensor group: every rank calls it, for the same parameters in the same
        order). A parameter the plan leaves whole is returned as it is."""
        found = self.split_of(param)
        if found is None:
            return local
        return gather_whole(local, self.group, found.dim)

    def whole_shape(self, param: Any) -> tuple[int, ...] | None:
        """The whole shape of a split parameter (None: the plan leaves it whole)."""
        found = self.split_of(param)
        return None if found is None else found.full_shape

    def local_part(self, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `whole`, a whole value of `param` (no communication)."""
        found = self.split_of(param)
        if found is None:
            return whole
        return whole.chunk(self.size, dim=found.dim)[self.rank]


class SplitPlan:
    """What `plan_split` found to split: checked, nothing changed yet (`apply` splits)."""

    def __init__(
        self,
        module: nn.Module,
        targets: list[_Target],
        splits: dict[nn.Parameter, tuple[int, str]],
        size: int,
    ) -> None:
        self.module = module
        self.targets = targets
        self.splits = splits
        self.size = size

    @torch.no_grad()
    def apply(self, group: TensorGroup) -> TensorSplit:
        """Split the module in place: this rank's slices, the parallel classes, local heads."""
        if group.size != self.size:
            raise ValueError(f"planned for {self.size} ranks, asked to split over {group.size}")
        params: dict[nn.Parameter, SplitParam] = {}
        for param, (dim, name) in self.splits.items():
            full_shape = tuple(param.shape)
            param.data = param.data.chunk(self.size, dim=dim)[group.rank].clone()
            params[param] = SplitParam(name, dim, full_shape)
        for target in self.targets:
            _become_parallel(target, group)
        _localize_head_counts(self.module, self.targets, self.size)
        return TensorSplit(group, params, {t.name: t.style for t in self.targets})


def plan_split(module: nn.Module, plan: Plan, size: int) -> SplitPlan:
    """Check that `plan` can split `module` over `size` ranks (see the module docstring).

    Raises `ConfigError` listing every problem; changes nothing.
    """
    targets = _targets(module, plan)
    problems: list[str] = []
    for target in targets:
        problems += _module_problems(target, size)
    splits: dict[nn.Parameter, tuple[int, str]] = {}
    for target in targets:
        for param_name, param, dim in _split_dims(target):
            splits.setdefault(param, (dim, f"{target.name}.{param_name}"))
    by_target = {id(t.module): t for t in targets}
    problems += _sharing_problems(splits, _owners(module), by_target)
    problems += _head_problems(module, targets, size)
    if problems:
        raise ConfigError(
            f"tensor_parallel.autotp_size {size} cannot split {type(module).__name__} by "
            f"{plan.source.value}: " + "; ".join(problems)
        )
    return SplitPlan(module, targets, splits, size)


def _targets(module: nn.Module, plan: Plan) -> list[_Target]:
    targets = []
    unsupported = []
    used: set[str] = set()
    for name, sub in module.named_modules():
        found = plan.style_of(name) if name else None
        if found is None:
            continue
        pattern, style = found
        used.add(pattern)
        if not isinstance(style, Style):
            unsupported.append(f"'{name}' is {style!r} ({pattern!r})")
            continue
        targets.append(_Target(name, sub, style))
    if unsupported:
        raise ConfigError(
            f"{plan.source.value} gives modules styles zerodp does not implement: "
            + ", ".join(unsupported)
            + '; zerodp splits "colwise", "rowwise", "colwise_gather_output" and '
            '"embedding_rowwise": give tensor_parallel.plan without these modules (they stay '
            "whole) or with one of those styles"
        )
    if plan.source is PlanSource.CONFIG:
        unmatched = [p for p in plan.entries if p not in used]
        if unmatched:
            raise ConfigError(
                f"tensor_parallel.plan: {', '.join(repr(p) for p in unmatched)} match no module "
                f"of {type(module).__name__}; patterns are module names as named_modules() "
                "gives them, '*' standing for one part (e.g. 'layers.*.mlp.fc1')"
            )
    elif not targets:
        # A model's own plan may name modules a variant lacks, but one that names none of
        # this model's would leave it whole on every rank: T times the work, no split.
        shown = ", ".join(repr(p) for p in list(plan.entries)[:4])
        raise ConfigError(
            f"{plan.source.value} of {type(module).__name__} matches none of its modules "
            f"({shown}, ...), so nothing would be split (a wrapped model names its modules "
            "differently); give tensor_parallel.plan with patterns of its named_modules(), or "
            "set tensor_parallel.autotp_size to 1"
        )
    return targets


def _module_problems(target: _Target, size: int) -> list[str]:
    module, name, style = target.module, target.name, target.style
    if style in _LINEAR_STYLES:
        if type(module) is not nn.Linear:
            return [
                f"'{name}' is {style.value!r} but a {type(module).__name__}, not an nn.Linear "
                "(zerodp splits plain Linear layers; leave it out of the plan)"
            ]
        features = module.out_features if style.split_dim == 0 else module.in_features
        kind = "output features" if style.split_dim == 0 else "input features"
    else:
        if type(module) is not nn.Embedding:
            return [
                f"'{name}' is {style.value!r} but a {type(module).__name__}, not an nn.Embedding"
            ]
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            return [
                f"'{name}' uses max_norm, sparse or scale_grad_by_freq, which a "
                "vocabulary-parallel embedding does not support; leave it out of the plan"
            ]
        features, kind = module.num_embeddings, "rows (its vocabulary)"
    if features % size != 0:
        return [f"'{name}' has {features} {kind}, not divisible by {size}"]
    return []


def _split_dims(target: _Target) -> Iterator[tuple[str, nn.Parameter, int]]:
    """(name, parameter, dimension) for each parameter `target`'s style splits."""
    module, style = target.module, target.style
    weight = module._parameters.get("weight")
    if weight is not None:
        yield "weight", weight, style.split_dim
    bias = module._parameters.get("bias")
    if bias is not None and style in (Style.COLWISE, Style.COLWISE_GATHER_OUTPUT):
        yield "bias", bias, 0  # a row-parallel bias is whole: added once, after the sum


def _owners(module: nn.Module) -> dict[nn.Parameter, list[tuple[str, nn.Module, str]]]:
    """Every (module name, module, attribute) that holds each parameter directly."""
    owners: dict[nn.Parameter, list[tuple[str, nn.Module, str]]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for attribute, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(param, []).append((name, sub, attribute))
    return owners


def _sharing_problems(
    splits: dict[nn.Parameter, tuple[int, str]],
    owners: dict[nn.Parameter, list[tuple[str, nn.Module, str]]],
    by_target: dict[int, _Target],
) -> list[str]:
    problems = []
    for param, (dim, name) in splits.items():
        for owner_name, owner, attribute in owners.get(param, []):
            where = f"{owner_name}.{attribute}" if owner_name else attribute
            target = by_target.get(id(owner))
            if target is None:
                problems.append(
                    f"'{name}' is shared with '{where}' (tied weights), which the plan leaves "
                    "whole: split both the same way (an lm_head tied to the input embeddings "
                    'goes with "embedding_rowwise" for them) or neither'
                )
                continue
            split = dict((n, d) for n, _, d in _split_dims(target))
            if split.get(attribute) != dim:
                problems.append(
                    f"'{name}' is shared with '{where}' (tied weights), whose style "
                    f"{target.style.value!r} splits it along another dimension: split both "
                    "the same way"
                )
    return problems


def _head_counts(module: nn.Module) -> tuple[int, int] | None:
    """(attention heads, key/value heads) from a Hugging Face model's config, if it says."""
    config: Any = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None)
    return heads, kv_heads if isinstance(kv_heads, int) else heads


def _splits_attention(module: nn.Module, targets: list[_Target]) -> bool:
    """Whether the plan splits a Linear of an attention block (a parent whose class name says
    Attention, as Hugging Face names them)."""
    return any(
        "attention" in type(parent).__name__.lower() for parent, _ in _parents_of(module, targets)
    )


def _head_problems(module: nn.Module, targets: list[_Target], size: int) -> list[str]:
    counts = _head_counts(module) if _splits_attention(module, targets) else None
    problems = []
    if counts is not None:
        heads, kv_heads = counts
        if kv_heads < size:
            problems.append(
                f"the model has {kv_heads} key/value heads, fewer than autotp_size {size} "
                "(grouped-query attention): each rank needs whole key/value heads and zerodp "
                f"does not replicate them; use an autotp_size that divides {kv_heads}"
            )
        elif heads % size or kv_heads % size:
            problems.append(
                f"the model's {heads} attention heads and {kv_heads} key/value heads do not "
                f"both divide by {size}: use an autotp_size that divides both"
            )
    for parent, name in _parents_of(module, targets):
        for attribute in HEAD_COUNT_ATTRIBUTES:
            value = getattr(parent, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % size:
                problems.append(f"'{name}.{attribute}' is {value}, not divisible by {size}")
    return problems


def _parents_of(module: nn.Module, targets: list[_Target]) -> list[tuple[nn.Module, str]]:
    """The distinct modules that hold a split Linear as a child (attention and MLP blocks)."""
    names = {t.name.rpartition(".")[0] for t in targets if t.style in _LINEAR_STYLES}
    found = []
    for name, sub in module.named_modules():
        if name in names and name:
            found.append((sub, name))
    return found


def _localize_head_counts(module: nn.Module, targets: list[_Target], size: int) -> None:
    for parent, _ in _parents_of(module, targets):
        for attribute in HEAD_COUNT_ATTRIBUTES:
            value = getattr(parent, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(parent, attribute, value // size)


def _become_parallel(target: _Target, group: TensorGroup) -> None:
    module, style = target.module, target.style
    if style is Style.ROWWISE:
        make_row_parallel(module, group)  # type: ignore[arg-type]
    elif style is Style.EMBEDDING_ROWWISE:
        rows = cast(nn.Embedding, module).weight.shape[0]
        make_vocab_parallel(module, group, vocab_start=group.rank * rows)  # type: ignore[arg-type]
    else:
        make_column_parallel(
            module,  # type: ignore[arg-type]
            group,
            gather_output=style is Style.COLWISE_GATHER_OUTPUT,
        )
