"""Tensor parallelism in the engine: the split before the layout, the parts kept after it.

1. `split_model` (before the flat groups are laid out): splits the model by its
   plan (`zerodp.tensor_parallel.split_for_engine`).
   Each rank's slices are then ordinary parameters to ZeRO: laid out in their own
   flat groups (`FlatGroup.tensor_split`), sharded over the shard group, which
   with T > 1 is exactly the ranks holding the same slices.
2. `tensor_parallelism` (once the optimizer is built): keeps the checks (the same
   batch, the whole parameters equal across each tensor group) with the values
   they compare: the engine's own buffers of the groups the plan leaves whole.
What does not compose (a model built under `zero.Init`, an optimizer that reads
whole tensors) is refused for every dimension by `zerodp.engine.composition_checks`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.group_state import GroupIndex
from zerodp.tensor_parallel import TensorParallelism, TensorSplit, split_for_engine


def split_model(
    module: nn.Module, config: ZeroDPConfig, comms: GroupComms, device: torch.device
) -> TensorSplit | None:
    """Split `module` for `config.tensor_parallel` (None: no tensor parallelism)."""
    tp = config.tensor_parallel
    if not tp.enabled:
        return None
    return split_for_engine(module, tp, comms, device)


def tensor_parallelism(
    module: nn.Module,
    config: ZeroDPConfig,
    comms: GroupComms,
    split: TensorSplit | None,
    groups: GroupIndex,
) -> TensorParallelism | None:
    """The parts an engine with tensor parallelism keeps (None without it)."""
    if split is None:
        return None

    def whole_values() -> list[tuple[str, torch.Tensor]]:
        return _whole_values(module, groups, split)

    return TensorParallelism(
        module,
        split,
        comms,
        whole_values,
        verify_each_step=config.tensor_parallel.verify_replicated,
    )


def _whole_values(
    module: nn.Module, groups: GroupIndex, split: TensorSplit
) -> list[tuple[str, torch.Tensor]]:
    """The tensors holding the parameters the plan leaves whole: each group's shard (sharded
    groups) or full buffer, its optimizer copy, and the parameters no group manages."""
    out: list[tuple[str, torch.Tensor]] = []
    for state in groups:
        flat = state.flat
        if flat.tensor_split:
            continue
        names = state.names
        label = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} in its group)"
        out.append((label, flat.shard if state.gather is not None else flat.full))
        if state.optim is not None and state.optim.copy is not None:
            out.append((f"{label}, optimizer copy", state.optim.copy))
    for name, param in module.named_parameters():
        if not groups.manages(param) and not split.is_split(param):
            out.append((name, param.detach()))
    return out
