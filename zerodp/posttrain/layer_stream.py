"""Generation with one block gathered at a time: for a model whose whole does not fit.

`gathered_for_generation(layer_by_layer=True)` gathers the groups outside the
blocks (embeddings, final norm, output layer) once, and each block's groups when
the block is entered, with the gathers of the next `prefetch_blocks` blocks
issued right away so that they arrive while this one computes. A block's groups
are released when it returns. So at most the rest of the model plus
`1 + prefetch_blocks` blocks are gathered at any time, and the only hooks are one
pre- and one post-hook per block (none on the modules inside it).

Blocks are taken to run in list order, wrapping around (a decoder's layers run
0..L-1 on every forward, and generation runs one forward per token); a block
that runs out of order is gathered when it is entered, and whatever was
prefetched for it waits until it is used or the context ends.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.errors import UsageError
from zerodp.group_state import GroupIndex, GroupState
from zerodp.posttrain.holding import sharded_groups_of
from zerodp.stage3.gatherer import GroupGatherer


def find_blocks(root: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the members of its longest `nn.ModuleList`.

    A Hugging Face decoder's layers (`model.layers`, `transformer.h`) are that list.
    """
    best: list[nn.Module] = []
    for module in root.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            members = list(module)
            if all(next(m.parameters(), None) is not None for m in members):
                best = members
    if len(best) < 2:
        raise UsageError(
            "gathered_for_generation(layer_by_layer=True) found no nn.ModuleList of blocks "
            "in the model; pass the modules to gather one at a time as blocks=[...] (a "
            "decoder's layers, in the order they run)"
        )
    return best


def check_blocks(root: nn.Module, blocks: list[nn.Module], prefetch_blocks: int) -> None:
    if not isinstance(prefetch_blocks, int) or prefetch_blocks < 0:
        raise UsageError(
            f"prefetch_blocks must be an int >= 0 (blocks gathered ahead), got {prefetch_blocks!r}"
        )
    inside = {id(m) for m in root.modules()}
    if not blocks or any(not isinstance(b, nn.Module) or id(b) not in inside for b in blocks):
        raise UsageError(
            "blocks= must be a non-empty list of submodules of the engine's model, in the "
            "order they run"
        )
    if len({id(b) for b in blocks}) != len(blocks):
        raise UsageError("blocks= lists a module twice; list each block once")


class BlockStream:
    """Holds the rest of the model, and one block (plus what is prefetched) at a time."""

    def __init__(
        self,
        gatherer: GroupGatherer,
        index: GroupIndex,
        blocks: list[nn.Module],
        prefetch_blocks: int,
    ) -> None:
        self.gatherer = gatherer
        self.blocks = blocks
        self.prefetch_blocks = min(prefetch_blocks, len(blocks) - 1)
        self.block_groups = [sharded_groups_of(b.parameters(), index) for b in blocks]
        in_blocks = {id(s) for groups in self.block_groups for s in groups}
        self.rest = [s for s in gatherer.states if id(s) not in in_blocks]
        self._handles: list[RemovableHandle] = []

    def open(self) -> None:
        self.gatherer.hold_all(self.rest)
        for position, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(position)))
            self._handles.append(
                block.register_forward_hook(self._post_hook(position), always_call=True)
            )
        for position in range(self.prefetch_blocks):
            self._prefetch(position)

    def close(self) -> None:
        """Remove the hooks; release what was prefetched and never used, and the rest."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for groups in self.block_groups:
            for state in groups:
                self.gatherer.release(state)  # a gather in flight is finished first
        self.gatherer.unhold_all(self.rest)

    def _pre_hook(self, position: int) -> Any:
        def enter(module: nn.Module, args: Any) -> None:
            self.gatherer.hold_all(self.block_groups[position])
            for ahead in range(1, self.prefetch_blocks + 1):
                self._prefetch((position + ahead) % len(self.blocks))

        return enter

    def _post_hook(self, position: int) -> Any:
        def leave(module: nn.Module, args: Any, output: Any) -> None:
            self.gatherer.unhold_all(self.block_groups[position])

        return leave

    def _prefetch(self, position: int) -> None:
        groups: list[GroupState] = self.block_groups[position]
        for state in groups:
            self.gatherer.prefetch(state)
