"""Ranks that take different paths without leaf modules: one clear error, on every rank, in seconds.

Without the collective order check (`zerodp.comm.faults.collective_order`), a rank that
runs a module the others skip pairs its all-gather with whatever the others issue next: gloo
aborts the process when the sizes differ, and with equal sizes (two experts of one shape)
training finishes with wrong weights (`test_two_experts_of_one_shape`, with the check off). With the
check, every rank raises the same `DivergenceError`, naming what each rank was gathering or
reducing and the module to mark as a leaf: at once when the ranks diverge in a pass they
check through the store (the first of its kind), and within about a second when a rank
leaves an order agreed earlier while the others keep to it (they are waiting in a
collective the rank never joins, and answer its alarm). Each test bounds the time.
Ranks that take the same new path are no error, and steady training exchanges nothing.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import LifecycleNet, lifecycle_inputs
from tests.moe_models import (
    Gated,
    GatedNet,
    MoEConfig,
    MoELM,
    TopOneBlock,
    TwoExpertNet,
    VisionLM,
    lm_loss,
    moe_inputs,
    two_expert_inputs,
    vision_inputs,
)
from zerodp.comm.faults.collective_order import DEFAULT_TIMEOUT_S
from zerodp.comm.process_group import comms_timeout
from zerodp.testing import ReferenceDP, run_distributed
from zerodp.testing.parity import assert_params_match

SGD = optimizer_config("SGD", lr=0.1)
SECONDS = 6.0  # the bound on reporting a divergence (the check polls once a second)


def _engine(model: torch.nn.Module, **zero):
    config = zerodp_config(3, optimizer=SGD, persistence_threshold=0, zero=zero or None)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    return engine


def _error_of(step) -> tuple[str, float]:
    """The DivergenceError `step()` raises, and how long it took."""
    start = time.perf_counter()
    with pytest.raises(zerodp.DivergenceError) as error:
        step()
    return str(error.value), time.perf_counter() - start


def _assert_agreed(results: list[tuple[str, float]], *fragments: str) -> str:
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages  # every rank raises the same message
    message = messages.pop()
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert all(elapsed < SECONDS for _, elapsed in results), results
    return message


# -- diverging in the first pass (checked through the store) -----------------------------------


def moe_first_step() -> tuple[str, float]:
    """One group per module: ranks routing to different experts gather different groups. (With
    each block one unit, the default, every rank gathers the whole block, but a rank whose
    tokens skip an expert completes the block's gradient early, which the check reports as a
    reduction while others gather; leaves are the answer either way.)"""
    torch.manual_seed(0)
    cfg = MoEConfig()
    model = MoELM(cfg)
    engine = _engine(model, stage3_units="modules")
    tokens = moe_inputs(dist.get_rank(), 0, cfg)
    return _error_of(lambda: engine.backward(lm_loss(engine(tokens), tokens)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_without_leaves_raises_on_every_rank(pools, world_size: int) -> None:
    message = _assert_agreed(
        pools(world_size).run(moe_first_step, timeout_s=60),
        "forward pass 1",
        "rank 0 gathers the parameters of `blocks.0.moe.experts.",
        "rank 1 gathers the parameters of `blocks.0.moe.experts.",
        "set_z3_leaf_modules(model, [MoEBlock])",
    )
    assert "inside `blocks.0.moe` (MoEBlock)" in message


def vision_first_step() -> tuple[str, float]:
    torch.manual_seed(0)
    model = VisionLM()
    engine = _engine(model)
    tokens, images = vision_inputs(dist.get_rank(), 0, with_images=dist.get_rank() == 0)
    return _error_of(lambda: engine(tokens, images))


def test_branch_without_leaf_raises_on_every_rank(pools) -> None:
    _assert_agreed(
        pools(2).run(vision_first_step, timeout_s=60),
        "rank 0 gathers the parameters of `embed.vision.patch`",
        "rank 1 gathers the parameters of `body.0`",
        "make every rank run the same modules",
    )


def gated_first_step(leaf: bool) -> tuple[str, float] | float:
    """A module using one of its own parameters on some ranks only: its gradients are complete
    on those ranks early (they would reduce while the others gather)."""
    torch.manual_seed(0)
    model = GatedNet()
    reference = ReferenceDP(copy.deepcopy(model), lambda p: torch.optim.SGD(p, lr=0.1))
    if leaf:
        zerodp.zero.set_z3_leaf_modules(model, [Gated])
    engine = _engine(model, stage3_prefetch_bucket_size=0)
    rank = dist.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    use_extra = rank == 0
    if not leaf:
        return _error_of(lambda: engine.backward(engine(x, use_extra).square().mean()))
    for _ in range(2):
        engine.backward(engine(x, use_extra).square().mean())
        engine.step()
        reference.run_backward(lambda: reference.model(x, use_extra).square().mean().backward())
        reference.step()
        reference.zero_grad()
    assert_params_match(model, reference, "gated, as a leaf")
    engine.destroy()
    return 0.0


def test_parameter_used_on_some_ranks(pools) -> None:
    _assert_agreed(
        pools(2).run(gated_first_step, False, timeout_s=60),
        "backward pass 1",
        "reduces the gradients of `gated`",
        "gathers the parameters of `inp`",
        "set_z3_leaf_modules(model, [Gated])",
    )
    pools(2).run(gated_first_step, True)  # marked as a leaf: exact


# -- the case: two experts of one shape ----------------------------------------------------


def two_experts(check: bool, leaf: bool) -> tuple[str, float] | float:
    """Four SGD steps; the largest weight difference from the reference, or the error."""
    torch.manual_seed(0)
    model = TwoExpertNet()
    reference = ReferenceDP(copy.deepcopy(model), lambda p: torch.optim.SGD(p, lr=0.1))
    if leaf:
        zerodp.zero.set_z3_leaf_modules(model, [TopOneBlock])
    engine = _engine(model, stage3_check_order=check)
    rank = dist.get_rank()
    choices = []

    def train() -> None:
        for step in range(4):
            x = two_expert_inputs(rank, step)
            engine.backward(engine(x).square().mean())
            engine.step()
            choices.append(model.block.last_choice)
            reference.run_backward(lambda x=x: reference.model(x).square().mean().backward())
            reference.step()
            reference.zero_grad()

    if check and not leaf:
        return _error_of(train)
    train()
    assert choices == [rank % 2] * 4  # rank 0 routes to `expert`, rank 1 to `expert_b`
    full = zerodp.utils.safe_get_full_fp32_param(model.out.weight)
    engine.destroy()
    return float((full - reference.model.out.weight.detach()).abs().max())


def test_two_experts_of_one_shape(pools) -> None:
    # Without the check: no error, and wrong weights (the all-gathers pair up across experts).
    assert min(pools(2).run(two_experts, False, False)) > 1e-3
    _assert_agreed(
        pools(2).run(two_experts, True, False, timeout_s=60),
        "rank 0 gathers the parameters of `block.expert` ",
        "rank 1 gathers the parameters of `block.expert_b` ",
        "set_z3_leaf_modules(model, [TopOneBlock])",
    )
    assert max(pools(2).run(two_experts, True, True)) < 1e-6  # as a leaf: exact


# -- leaving an agreed order (the ranks that keep to it answer from their wait) ----------------


def branch_in_a_later_step() -> tuple[str, float]:
    """Three steps without images anywhere (the order is agreed, and the last step only
    replays it); in step 4 rank 0 alone has images, the other ranks keep to the order."""
    torch.manual_seed(0)
    model = VisionLM()
    engine = _engine(model)
    order = engine.params.order
    rank = dist.get_rank()

    def step(index: int, with_images: bool) -> None:
        tokens, images = vision_inputs(rank, index, with_images)
        engine.backward(lm_loss(engine(tokens, images), tokens))
        engine.step()

    checked = []
    for index in range(3):
        step(index, with_images=False)
        checked.append(order.num_checked)
    assert checked[2] == checked[1] > 0, checked  # the third step exchanged nothing
    return _error_of(lambda: step(3, with_images=rank == 0))


def test_leaving_the_agreed_order_raises_on_every_rank() -> None:
    # Fresh processes: the ranks that kept to the order leave collectives waiting.
    _assert_agreed(
        run_distributed(branch_in_a_later_step, 3, timeout_s=90),
        "forward pass 4",
        "rank 0 gathers the parameters of `embed.vision.patch`",
        "rank 1 ends its forward pass; rank 2 ends its forward pass",
    )


# -- no false alarm, and nothing exchanged in steady training ---------------------------------


def same_new_path() -> list[tuple[int, int]]:
    """Every rank takes a new path in step 2 (LifecycleNet's unused layer), then keeps to it."""
    torch.manual_seed(0)
    model = LifecycleNet()
    engine = _engine(model)
    order = engine.params.order
    counts = []
    for step, use_unused in enumerate([False, True, True, True, True]):
        x = lifecycle_inputs(dist.get_rank(), step)
        engine.backward(engine(x, use_unused=use_unused).square().mean())
        engine.step()
        counts.append((order.num_checked, order.num_replayed))
    engine.destroy()
    return counts


def test_the_same_new_path_everywhere_is_no_error(pools) -> None:
    for counts in pools(2).run(same_new_path):
        checked = [c for c, _ in counts]
        replayed = [r for _, r in counts]
        assert checked[1] > checked[0] > 0, counts  # step 1, and step 2 (a new path)
        assert checked[4] == checked[3], counts  # then replayed: nothing exchanged
        assert replayed[4] > replayed[3], counts


def test_the_check_can_be_turned_off(pools) -> None:
    assert pools(2).run(_order_of_unchecked) == [True, True]


def test_a_checked_pass_waits_as_long_as_a_collective(pools) -> None:
    """The store wait of a checked pass is bounded by comms_timeout_s, as collectives are."""
    from_env = comms_timeout(None)  # $ZERODP_COMMS_TIMEOUT_S, if the environment sets it
    default = DEFAULT_TIMEOUT_S if from_env is None else from_env.total_seconds()
    assert pools(2).run(_order_timeouts) == [(default, 42.0)] * 2


def _order_timeouts() -> tuple[float, float]:
    timeouts = []
    for extra in ({}, {"comms_timeout_s": 42}):
        config = zerodp_config(3, optimizer=SGD, persistence_threshold=0, **extra)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pool's process group exists already
            engine, _, _, _ = zerodp.initialize(model=LifecycleNet(), config=config)
        timeouts.append(engine.params.order.timeout_s)
        engine.destroy()
    return timeouts[0], timeouts[1]


def _order_of_unchecked() -> bool:
    engine = _engine(LifecycleNet(), stage3_check_order=False)
    unchecked = engine.params.order is None and engine.comm.on_stall is not None
    engine.destroy()
    # With the stall checks off too, nothing listens while a collective waits.
    config = zerodp_config(3, optimizer=SGD, persistence_threshold=0)
    config["zero_optimization"]["stage3_check_order"] = False
    config["comms_stall_checks"] = False
    engine, _, _, _ = zerodp.initialize(model=LifecycleNet(), config=config)
    unchecked = unchecked and engine.comm.on_stall is None
    engine.destroy()
    return unchecked
