"""Stage 3 installs the saved-tensor hooks only in the forward scopes that hold sharded groups
([Note: saving windows] in zerodp.stage3.saved_tensors).

Two things are checked. Where the hooks are: a block whose parameters are all persistent
saves nothing through them, a block with sharded parameters does. And that narrowing them
loses nothing: a sharded weight read where no scope holds it (between persistent blocks,
while it is kept gathered for its reuse by a tied output layer) is still saved through the
hooks, so a second backward on a retained graph and a gradient penalty (double backward)
match the data-parallel reference computed in the test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from zerodp.stage3.zero_parameter import ZeroParameter
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_grads_match, assert_params_match
from zerodp.zero import ParamStatus, param_status

DIM = 16
THRESHOLD = 200  # the tied 16x16 weight (256) is sharded; each block's (at most 144) is not
ADAMW = optimizer_config("AdamW", lr=1e-2, weight_decay=0.0)


def _reference_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, fused=True)


class WindowNet(nn.Module):
    """A tied input/output layer (sharded) around small blocks (persistent at THRESHOLD).

    With `read_between`, the root reads the tied weight between two blocks: no forward
    scope holds it there (the input layer's has ended; the head's has not begun), and it is
    gathered, kept for the head. `seen` records its class and status at that read.
    """

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, DIM)) for _ in range(blocks)
        )
        self.head = nn.Linear(DIM, DIM, bias=False)
        self.head.weight = self.inp.weight
        self.read_between = False
        self.seen: list[tuple[type, ParamStatus | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.read_between and i == 1:
                weight = self.inp.weight
                status = param_status(weight) if isinstance(weight, ZeroParameter) else None
                self.seen.append((type(weight), status))
                h = h + 0.5 * torch.tanh(F.linear(h, weight))
        return self.head(h)


def _inputs(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, DIM, generator=gen)


def _mse(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _plain(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backward: Any) -> None:
    backward(_mse(call(x)))


def _retained(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backward: Any) -> None:
    """Two losses of one forward, two backward passes over the retained graph."""
    out = call(x)
    backward(_mse(out), retain_graph=True)
    backward(out.abs().mean())


def _penalty(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, backward: Any) -> None:
    """A gradient penalty: autograd.grad(create_graph=True), then backward through it."""
    x = x.clone().requires_grad_(True)
    loss = _mse(call(x))
    (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
    backward(loss + grad_x.square().sum())


PATTERNS = {"plain": _plain, "retained": _retained, "penalty": _penalty}


def _ref_backward(loss: torch.Tensor, **kwargs: Any) -> None:
    loss.backward(**kwargs)


def _train_with_pattern(name: str) -> list[str]:
    """`name`'s pattern for 4 steps beside the reference, the out-of-scope read from step 1
    on; returns what each read found (the weight's class and status)."""
    pattern = PATTERNS[name]
    torch.manual_seed(0)
    model = WindowNet()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=THRESHOLD)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(ref_model, _reference_adamw)
    rank = dist.get_rank()
    for step in range(4):
        model.read_between = ref_model.read_between = step >= 1
        x = _inputs(rank, step)
        pattern(engine, x, engine.backward)
        reference.run_backward(lambda x=x: pattern(ref_model, x, _ref_backward))
        assert_grads_match(model, reference, f"{name}, step {step}")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_params_match(model, reference, f"{name}, after step {step}")
    engine.destroy()
    return [f"{cls.__name__}:{status.name if status else '-'}" for cls, status in model.seen]


def read_between_matches_reference() -> dict[str, list[str]]:
    return {name: _train_with_pattern(name) for name in PATTERNS}


def test_a_read_outside_every_scope_is_saved_through_the_hooks(pools) -> None:
    for rank_found in pools(2).run(read_between_matches_reference):
        for name, seen in rank_found.items():
            # The first read with the weight kept gathered and no scope claiming it: the case
            # that only the guarded class catches (a released weight would be gathered on use).
            assert seen[0] == "ZeroParameter:AVAILABLE", (name, seen)


def packs_by_place(threshold: int) -> dict[str, int]:
    """How many tensors one training step saves through zerodp's hooks, inside the blocks and
    elsewhere, and how many the forward saves in all (counted with hooks of the test's own
    wrapped around zerodp's)."""
    torch.manual_seed(0)
    model = WindowNet()
    config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=threshold)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    gatherer = engine.params.saved_tensors
    counts = {"in_blocks": 0, "elsewhere": 0}
    inside = [0]
    original = gatherer.pack

    def counting_pack(tensor: torch.Tensor) -> Any:
        counts["in_blocks" if inside[0] else "elsewhere"] += 1
        return original(tensor)

    def enter(*_: Any) -> None:
        inside[0] += 1

    def leave(*_: Any) -> None:
        inside[0] -= 1

    for block in model.blocks:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    x = _inputs(dist.get_rank(), 0)
    engine.backward(_mse(engine(x)))  # the first step records the order
    engine.step()
    gatherer.pack = counting_pack  # type: ignore[method-assign]
    engine.backward(_mse(engine(x)))
    engine.step()
    engine.destroy()
    return counts


def packs_at_both_thresholds() -> list[dict[str, int]]:
    return [packs_by_place(THRESHOLD), packs_by_place(0)]


def test_hooks_are_installed_only_where_sharded_groups_are_held(pools) -> None:
    persistent_blocks, sharded_blocks = pools(2).run(packs_at_both_thresholds)[0]
    assert persistent_blocks["in_blocks"] == 0, persistent_blocks
    assert persistent_blocks["elsewhere"] > 0, persistent_blocks  # the tied layers' scopes
    assert sharded_blocks["in_blocks"] > 0, sharded_blocks
