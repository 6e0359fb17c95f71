"""torch.compile for zerodp models: the `compile` config key, and compiled blocks at stage 3.

zerodp's hooks run outside compiled graphs; see [Note: stage 3 under torch.compile]
(`zerodp.stage3.compiled`) for stage 3. What this module decides:

- which modules are the model's blocks: `zerodp.partition.blocks.repeated_blocks`
  (the children of a `ModuleList` or `Sequential` whose children, two or more,
  all have one class: the usual stack of transformer blocks);
- at stage 3, which modules are gathered as one unit (a leaf): every module
  the user compiled by itself (`torch.compile(block)`), and the blocks of a
  model compiled whole (`torch.compile(model)`); the graph breaks only at
  their boundaries;
- what the `compile` config block compiles: each block (the default at stage
  3) or the whole model (the default at stages 0-2), by compiling `forward`,
  so the module's hooks, and zerodp's, stay outside the graph and the state
  dict's names are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerodp.config import CompileConfig
from zerodp.errors import ConfigError
from zerodp.partition.blocks import repeated_blocks
from zerodp.stage3.leaf import mark_leaf_modules

_COMPILED = torch._dynamo.eval_frame.OptimizedModule


def _inner(module: nn.Module) -> nn.Module:
    return module._orig_mod if isinstance(module, _COMPILED) else module


def compiled_units(model: nn.Module) -> list[nn.Module]:
    """What stage 3 gathers as one unit because the user compiled it: each module compiled by
    itself, and the blocks of a model compiled whole."""
    # A block compiled by itself is the unit as its wrapper: the wrapper's hooks run outside
    # dynamo, its `_orig_mod`'s inside (see [Note: stage 3 under torch.compile]).
    units: list[nn.Module] = [
        m for m in model.modules() if isinstance(m, _COMPILED) and m is not model
    ]
    if isinstance(model, _COMPILED):
        wrapped = [_inner(u) for u in units]
        units += [b for b in repeated_blocks(_inner(model)) if b not in units + wrapped]
    return units


def prepare_stage3(model: nn.Module, config: CompileConfig) -> None:
    """Before stage 3 installs its hooks: make compiled modules (and those the config will
    compile) leaves, so their subtree is gathered at their boundary."""
    units = compiled_units(model)
    if config.enabled:
        # Per block: the compiled blocks; whole model: its blocks all the same (the graph
        # breaks at their boundaries), if it has any.
        blocks = (
            _blocks_or_error(model)
            if compiles_per_block(config, stage=3)
            else repeated_blocks(_inner(model))
        )
        units += [b for b in blocks if b not in units]
    mark_leaf_modules(units)


def _blocks_or_error(model: nn.Module) -> list[nn.Module]:
    blocks = repeated_blocks(_inner(model))
    if not blocks:
        raise ConfigError(
            f"config key 'compile': no blocks found in {type(model).__name__} (a ModuleList or "
            'Sequential of two or more modules of one class); set "per_block": false to '
            "compile the whole model"
        )
    return blocks


def compiles_per_block(config: CompileConfig, stage: int) -> bool:
    return config.per_block if config.per_block is not None else stage == 3


def apply_compile(model: nn.Module, config: CompileConfig, stage: int) -> list[nn.Module]:
    """Compile what the `compile` block asks for; returns the modules whose forward is compiled."""
    if not config.enabled:
        return []
    targets = _blocks_or_error(model) if compiles_per_block(config, stage) else [_inner(model)]
    options: dict[str, Any] = dict(config.kwargs)
    for module in targets:
        module.forward = torch.compile(module.forward, backend=config.backend, **options)
    return targets
