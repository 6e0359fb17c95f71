"""`param.data = t` after `zerodp.initialize`: kept, or dropped where the docs say, never lost.

Every managed parameter is a view of its group's flat buffer; assigning `.data` swaps the
tensor under it. Before this was handled, stages 0-2 went on stepping the buffer while the
parameter showed `t` (it never trained again) and stage 3 lost a modifier rank's
assignment inside `GatheredParameters`. The reference is a plain model copy per rank that
makes the same assignment, gradients averaged with an explicit all_reduce.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_params_match

SGD = optimizer_config("SGD", lr=0.1, momentum=0.9)


def _reference(model: torch.nn.Module) -> tuple[torch.nn.Module, ReferenceDP]:
    ref_model = copy.deepcopy(model)
    return ref_model, ReferenceDP(ref_model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))


def _train(engine, model, ref_model, reference, steps: int, start: int, label: str) -> None:
    rank = dist.get_rank()
    for step in range(start, start + steps):
        x = tiny_inputs(rank, step)
        engine.backward(engine(x).square().mean())
        reference.run_backward(lambda x=x: ref_model(x).square().mean().backward())
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_params_match(model, reference, f"{label}, step {step}")


def _new_weight(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def assignment_is_kept(stage: int) -> None:
    """Every rank assigns `.data` between steps (stages 0-2 directly; at stage 3 the
    small persistent norm directly, the sharded weight through a modifier rank)."""
    torch.manual_seed(0)
    model = TinyNet()
    ref_model, reference = _reference(model)
    # The LayerNorm (22 elements) stays gathered at stage 3; the Linear layers are sharded.
    config = zerodp_config(stage, optimizer=SGD, persistence_threshold=30)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    label = f"stage {stage}"
    _train(engine, model, ref_model, reference, 2, 0, label)

    weight, norm = _new_weight(model.fc1.weight.shape, 1), _new_weight(model.norm.weight.shape, 2)
    ref_model.fc1.weight.data = weight.clone()
    ref_model.norm.weight.data = norm.clone()
    if stage == 3:
        with zerodp.zero.GatheredParameters([model.fc1.weight], modifier_rank=0):
            if dist.get_rank() == 0:
                model.fc1.weight.data = weight.clone()
    else:
        model.fc1.weight.data = weight.clone()
    model.norm.weight.data = norm.clone()
    _train(engine, model, ref_model, reference, 3, 2, f"{label} after assigning .data")
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_assigned_data_trains_like_the_reference(pools, stage: int) -> None:
    pools(2).run(assignment_is_kept, stage)


def master_takes_assignment(stage: int) -> None:
    """bf16 with fp32 masters: the master takes the assigned values (a zero gradient, so
    the step moves nothing)."""
    torch.manual_seed(0)
    model = TinyNet()
    config = zerodp_config(stage, optimizer=optimizer_config("SGD", lr=0.1), dtype="bf16")
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    weight = _new_weight(model.fc2.weight.shape, 3).to(torch.bfloat16)
    model.fc2.weight.data = weight.clone()
    engine.backward(engine(tiny_inputs(dist.get_rank(), 0).bfloat16()).float().sum() * 0.0)
    engine.step()
    master = zerodp.utils.safe_get_full_fp32_param(model.fc2.weight)
    assert torch.equal(master, weight.float()), (master - weight.float()).abs().max()
    assert torch.equal(model.fc2.weight.detach(), weight)
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_the_fp32_master_takes_an_assigned_data(pools, stage: int) -> None:
    pools(2).run(master_takes_assignment, stage)


def dropped_without_modifier() -> None:
    """Stage 3, no modifier rank: the assignment is dropped like any write, and the
    parameter goes on viewing its group (it trains like the untouched reference)."""
    torch.manual_seed(0)
    model = TinyNet()
    ref_model, reference = _reference(model)
    config = zerodp_config(3, optimizer=SGD, persistence_threshold=0)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    with zerodp.zero.GatheredParameters([model.fc1.weight]):
        model.fc1.weight.data = torch.zeros_like(model.fc1.weight)
    _train(engine, model, ref_model, reference, 3, 0, "stage 3, dropped assignment")
    engine.destroy()


def test_stage3_drops_an_assignment_without_modifier_rank(pools) -> None:
    pools(2).run(dropped_without_modifier)


def refused(stage: int) -> str:
    """What zerodp cannot keep (another dtype, another shape) is an error naming the fix,
    on every rank, before anything changed."""
    torch.manual_seed(0)
    model = TinyNet()
    config = zerodp_config(stage, optimizer=SGD, persistence_threshold=0)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    before = [zerodp.utils.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    if stage == 3:
        gathered = zerodp.zero.GatheredParameters([model.fc1.weight], modifier_rank=0)
        with pytest.raises(zerodp.ParamStateError) as caught, gathered:
            if dist.get_rank() == 0:
                model.fc1.weight.data = torch.zeros(3, 3)
    else:
        model.half()  # every rank: a dtype zerodp's buffer does not have
        engine.backward(engine(tiny_inputs(dist.get_rank(), 0).half()).float().square().mean())
        with pytest.raises(zerodp.ParamStateError) as caught:
            engine.step()
    after = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    engine.destroy()
    return str(caught.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_assignment_that_cannot_be_kept_is_refused(pools, stage: int) -> None:
    messages = pools(2).run(refused, stage)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert "copy_" in messages[0] and "replaced after zerodp.initialize" in messages[0], messages[0]


def saved_after_assignment(stage: int, directory: str) -> None:
    """A save right after `param.data = t` (no step in between) holds `t`, master included."""
    torch.manual_seed(0)
    model = TinyNet()
    # bf16 at stages 1-3: the save's fp32 master must take `t` too, not keep the old value.
    config = zerodp_config(
        stage, optimizer=SGD, persistence_threshold=30, dtype="fp32" if stage == 0 else "bf16"
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    value = _new_weight(model.norm.weight.shape, 4).to(model.norm.weight.dtype)
    model.norm.weight.data = value.clone()  # persistent at stage 3 (22 elements < 30)
    engine.save_checkpoint(directory, tag="assigned")
    engine.destroy()
    torch.manual_seed(1)  # other initial weights: the values must come from the checkpoint
    fresh = TinyNet()
    engine, _, _, _ = zerodp.initialize(model=fresh, config=config)
    engine.load_checkpoint(directory, tag="assigned")
    loaded = zerodp.utils.safe_get_full_fp32_param(fresh.norm.weight)
    assert torch.equal(loaded, value.float()), (loaded - value.float()).abs().max()
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_save_right_after_an_assignment_holds_it(pools, tmp_path, stage: int) -> None:
    pools(2).run(saved_after_assignment, stage, str(tmp_path / "ckpt"))
