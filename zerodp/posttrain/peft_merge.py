"""PEFT LoRA adapters merged into the weights as they stream out, without changing the model.

`full_parameters(merge_adapters=True)` yields what `peft_model.merge_and_unload()
.state_dict()` would hold, computed on the fly: the model itself (its base
weights, adapters and wrappers) is left as it is. PEFT is not imported; its
modules are recognised by what they have:

- a LoRA layer has `lora_A`, `lora_B`, `get_base_layer()` and
  `get_delta_weight(adapter)`: its `base_layer.weight` comes out under the
  layer's own name with `get_delta_weight(a)` added for each active adapter not
  merged yet (PEFT's own arithmetic, so the result is PEFT's to the bit), its
  `base_layer.bias` with `lora_B[a].bias * scaling[a]` added when the adapter
  has a LoRA bias; its adapter parameters do not come out;
- a `modules_to_save` wrapper has `original_module` and `modules_to_save`: the
  active adapter's copy comes out under the wrapper's name, nothing else of it;
- a `PeftModel` root's `base_model.model.` prefix is dropped, as
  `merge_and_unload()` returns the inner model.

LoRA variants (DoRA and the others) merge by their own rules and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.errors import UsageError

BASE = "base_layer."


def is_lora_layer(module: nn.Module) -> bool:
    return (
        hasattr(module, "lora_A")
        and hasattr(module, "lora_B")
        and callable(getattr(module, "get_delta_weight", None))
        and callable(getattr(module, "get_base_layer", None))
    )


def _is_modules_to_save(module: nn.Module) -> bool:
    return hasattr(module, "original_module") and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict
    )


def _peft_prefix(root: nn.Module) -> str:
    base = getattr(root, "base_model", None)
    if hasattr(root, "peft_config") and isinstance(getattr(base, "model", None), nn.Module):
        return "base_model.model."
    return ""


@dataclass(frozen=True)
class LoraMerge:
    """Adds a LoRA layer's adapters to its base layer's `weight` or `bias`."""

    layer: nn.Module
    adapters: tuple[str, ...]
    part: str  # "weight" or "bias"

    def lora_params(self) -> list[nn.Parameter]:
        """What the deltas read: the layer's parameters outside its base layer."""
        return [p for n, p in self.layer.named_parameters() if not n.startswith(BASE)]

    @torch.no_grad()
    def apply(self, value: torch.Tensor) -> None:
        """Add the deltas to `value` (the base weight or bias, a copy), as PEFT's merge does."""
        layer: Any = self.layer
        for adapter in self.adapters:
            if self.part == "weight":
                value.add_(layer.get_delta_weight(adapter))
            else:
                value.add_(layer.lora_B[adapter].bias * layer.scaling[adapter])


def _adapters_to_merge(layer: Any, name: str) -> tuple[str, ...]:
    merged = set(getattr(layer, "merged_adapters", []))
    known = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    adapters = tuple(a for a in layer.active_adapters if a in known and a not in merged)
    for adapter in adapters:
        if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(
            adapter, False
        ):
            raise UsageError(
                f"full_parameters(merge_adapters=True): adapter {adapter!r} of {name!r} is a "
                "LoRA variant (DoRA or another), which zerodp does not merge; stream the "
                "weights unmerged (merge_adapters=False) and merge them with PEFT"
            )
    return adapters


class MergedNames:
    """Maps the model's state_dict names to the merged model's, and says what to merge."""

    def __init__(self, root: nn.Module) -> None:
        self.prefix = _peft_prefix(root)
        self.lora: dict[str, nn.Module] = {}
        self.wrappers: dict[str, nn.Module] = {}
        for name, module in root.named_modules():
            if is_lora_layer(module):
                self.lora[name] = module
            elif _is_modules_to_save(module):
                self.wrappers[name] = module
        if not self.lora and not self.wrappers:
            raise UsageError(
                "full_parameters(merge_adapters=True): the model has no PEFT adapter (no "
                "module with lora_A/lora_B, no modules_to_save wrapper); pass "
                "merge_adapters=False"
            )

    def resolve(self, name: str) -> tuple[str | None, LoraMerge | None]:
        """(the merged model's name for `name`, or None if it is left out; what to add)."""
        owner, rest = self._owner(name)
        merge = None
        if owner is not None and owner in self.lora:
            if not rest.startswith(BASE):
                return None, None  # the adapters' own parameters
            rest = rest[len(BASE) :]
            layer = self.lora[owner]
            adapters = _adapters_to_merge(layer, owner)
            if rest == "bias":
                lora_bias: Any = getattr(layer, "lora_bias", {})
                adapters = tuple(a for a in adapters if lora_bias.get(a, False))
            if adapters and rest in ("weight", "bias"):
                merge = LoraMerge(layer, adapters, rest)
            name = f"{owner}.{rest}" if owner else rest
        elif owner is not None:
            active = getattr(self.wrappers[owner], "active_adapter", None)
            if isinstance(active, list | tuple):
                active = active[0] if active else None
            copy = f"modules_to_save.{active}."
            if not rest.startswith(copy):
                return None, None  # the original module, or another adapter's copy
            rest = rest[len(copy) :]
            name = f"{owner}.{rest}" if owner else rest
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        return name, merge

    def _owner(self, name: str) -> tuple[str | None, str]:
        """The innermost LoRA layer or wrapper `name` lies in, and the rest of the name."""
        best: str | None = None
        for owner in (*self.lora, *self.wrappers):
            inside = not owner or name.startswith(owner + ".")
            if inside and (best is None or len(owner) > len(best)):
                best = owner
        if best is None:
            return None, name
        return best, name[len(best) + 1 :] if best else name
