"""A model's repeated blocks, and the stage 3 units made of them.

A *block* is a child of a `ModuleList` or `Sequential` whose two or more
children all have one class and hold submodules: the usual stack of
transformer blocks, which FSDP2 recommends wrapping one `fully_shard` each.
`torch.compile`'s per-block mode and stage 3's default units (`"blocks"`)
both start from this list.
"""

from __future__ import annotations

from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every ModuleList/Sequential whose 2+ children share one class."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        alike = len(children) >= 2 and len({type(c) for c in children}) == 1
        if alike and not any(c in blocks for c in children):
            blocks += [c for c in children if next(iter(c.children()), None) is not None]
    return blocks


def runs_forward(module: nn.Module) -> bool:
    """Containers (ModuleList, ModuleDict) are never called: no hook of theirs ever fires."""
    return type(module).forward is not nn.Module.forward


def subtree_numel(module: nn.Module) -> int:
    """Parameter elements in `module`'s subtree, each shared parameter counted once."""
    return sum(p.numel() for p in module.parameters())


def claim_units(
    candidates: list[nn.Module], max_numel: int, excluded: set[nn.Module]
) -> dict[nn.Module, nn.Module]:
    """module -> the first candidate (in the given order) whose subtree holds it.

    A candidate is taken when it runs a forward of its own, holds between 1 and
    `max_numel` parameter elements, no module of its subtree is in `excluded`,
    and no candidate taken before holds it.
    """
    unit_of: dict[nn.Module, nn.Module] = {}
    for sub in candidates:
        if sub in unit_of or not runs_forward(sub):
            continue
        inside = list(sub.modules())
        numel = subtree_numel(sub)
        if numel == 0 or numel > max_numel or any(m in excluded for m in inside):
            continue
        for member in inside:
            unit_of.setdefault(member, sub)
    return unit_of


def plan_block_units(
    module: nn.Module, max_numel: int, excluded: set[nn.Module] | None = None
) -> dict[nn.Module, nn.Module]:
    """Stage 3 units by structure (`stage3_units: "blocks"`): each repeated block is one.

    A block over `max_numel` elements, or one holding an excluded module (a leaf,
    which has a gathering rule of its own), is not a unit: its modules keep one
    group each, and blocks nested inside it may be units. The root never is one.
    """
    blocks = [b for b in repeated_blocks(module) if b is not module]
    return claim_units(blocks, max_numel, excluded or set())
