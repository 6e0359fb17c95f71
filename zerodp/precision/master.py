"""fp32 master weights of the range each rank's optimizer steps (mixed precision only).

The optimizer updates the fp32 masters; the model's half-precision copy of the
same range is then overwritten from them (and all-gathered where the stage
keeps parameters whole). When parameters are modified outside the optimizer
(`GatheredParameters(modifier_rank=...)`, `safe_set_full_fp32_param`), the
masters are refreshed from the model so that the next step starts from the
modified values.
"""

from __future__ import annotations

import torch

from zerodp.partition import FlatGroup


class MasterWeights:
    def __init__(self) -> None:
        self._pairs: dict[int, tuple[FlatGroup, torch.Tensor, bool]] = {}

    def add(self, group: FlatGroup, master: torch.Tensor, owns_full_group: bool) -> None:
        self._pairs[id(group)] = (group, master, owns_full_group)

    def master_of(self, group: FlatGroup) -> torch.Tensor | None:
        pair = self._pairs.get(id(group))
        return None if pair is None else pair[1]

    def tensors(self) -> list[torch.Tensor]:
        return [master for _, master, _ in self._pairs.values()]

    @staticmethod
    def _model_copy(group: FlatGroup, owns_full_group: bool) -> torch.Tensor:
        return group.full if owns_full_group else group.shard

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for group, master, owns_full in self._pairs.values():
            self._model_copy(group, owns_full).copy_(master)

    @torch.no_grad()
    def refresh_from_model(self, group: FlatGroup) -> None:
        pair = self._pairs.get(id(group))
        if pair is not None:
            group, master, owns_full = pair
            master.copy_(self._model_copy(group, owns_full))

    def __len__(self) -> int:
        return len(self._pairs)
