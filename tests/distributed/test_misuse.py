"""Misuse gets an error with a message, on every rank, never a wrong number or a hang."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.lockstep import assert_all_released
from tests.models import LifecycleNet, TinyNet, lifecycle_inputs, tiny_inputs
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_grads_match, assert_params_match
from zerodp.zero import ParamStatus, param_status

ADAM = optimizer_config("Adam", lr=1e-2, adam_w_mode=False)  # torch.optim.Adam's update


class HookError(RuntimeError):
    pass


def backward_that_raises(stage: int, via_engine: bool) -> None:
    """A user hook raises half-way through backward; the engine must stay usable."""
    torch.manual_seed(0)
    model = LifecycleNet()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(stage, optimizer=ADAM, persistence_threshold=0)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(ref_model, lambda p: torch.optim.Adam(p, lr=1e-2))
    rank = dist.get_rank()

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise HookError("boom")

    # The middle block's output raises when its gradient arrives: after the output
    # layer's backward ran (gradients reduced, parameters gathered), before the rest.
    def arm(module: torch.nn.Module, inputs: object, out: torch.Tensor) -> None:
        out.register_hook(explode)

    handle = model.mid.register_forward_hook(arm)
    loss = engine(lifecycle_inputs(rank, 0)).square().mean()
    handle.remove()
    with pytest.raises(HookError):
        if via_engine:
            engine.backward(loss)
        else:
            loss.backward()

    # No parameter is left gathered (the dead task is found and aborted here).
    assert_all_released(model, stage, "after the failed backward")
    # Its gradients are incomplete: stepping now is refused, with the fix in the message.
    with pytest.raises(zerodp.LifecycleError, match="zero_grad"):
        engine.step()

    engine.zero_grad()
    for step in range(2):
        x = lifecycle_inputs(rank, step + 1)
        engine.backward(engine(x).square().mean())
        reference.run_backward(lambda x=x: ref_model(x).square().mean().backward())
        assert_grads_match(model, reference, f"stage {stage}: backward after the failure")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_params_match(model, reference, f"stage {stage}: step after the failure")
    assert engine.lifecycle.num_aborted == 1
    engine.destroy()


@pytest.mark.parametrize("via_engine", [True, False], ids=["engine_backward", "loss_backward"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_backward_that_raises_leaves_engine_usable(pools, stage: int, via_engine: bool) -> None:
    pools(2).run(backward_that_raises, stage, via_engine)


def misuse_errors(stage: int) -> list[str]:
    torch.manual_seed(0)
    model = TinyNet()
    config = zerodp_config(stage, optimizer=ADAM, persistence_threshold=0)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    x = tiny_inputs(dist.get_rank(), 0)
    messages = []

    with pytest.raises(ValueError, match="scalar") as error:
        engine.backward(engine(x))  # not reduced to a scalar
    messages.append(str(error.value))

    with pytest.raises(ValueError, match="does not require grad") as error:
        with torch.no_grad():
            loss = engine(x).square().mean()
        engine.backward(loss)
    messages.append(str(error.value))

    out = engine(x) * 1.0

    def step_inside_backward(grad: torch.Tensor) -> torch.Tensor:
        engine.step()
        return grad

    out.register_hook(step_inside_backward)
    with pytest.raises(zerodp.LifecycleError, match="inside a backward") as error:
        out.square().mean().backward()
    messages.append(str(error.value))
    engine.zero_grad()

    if stage == 3:
        weight = model.fc1.weight
        with pytest.raises(zerodp.ParamStateError, match="GatheredParameters") as error:
            weight.sum()  # a sharded parameter read outside forward
        messages.append(str(error.value))
        with pytest.raises(zerodp.ParamStateError, match=r"'fc1\.bias'"):
            model.fc1.bias * 2  # the second parameter of its group
        with zerodp.zero.GatheredParameters([weight]):
            assert torch.isfinite(weight.sum())
        assert param_status(weight) is ParamStatus.NOT_AVAILABLE

    engine.backward(engine(x).square().mean())  # and the engine still works
    engine.step()
    engine.destroy()
    return messages


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_misuse_raises_with_a_message(pools, stage: int) -> None:
    per_rank = pools(2).run(misuse_errors, stage)
    assert per_rank[0] == per_rank[1]


def bad_config_on_every_rank(config: dict) -> str:
    with pytest.raises(zerodp.ConfigError) as error:
        zerodp.initialize(model=TinyNet(), config=config)
    return str(error.value)


BAD_CONFIGS = {
    "misspelled_key": (
        {"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 1}},
        "did you mean 'zero_optimization'",
    ),
    "stage_out_of_range": (
        {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 4}},
        "zero_optimization.stage",
    ),
    "inconsistent_batch": (
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        "train_batch_size",
    ),
}
# A config without an optimizer is not an error: it builds an inference engine, whose
# backward and step name the fix (tests/distributed/test_posttrain_generation.py).


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_raises_on_every_rank(pools, name: str) -> None:
    config, expected = BAD_CONFIGS[name]
    messages = pools(2).run(bad_config_on_every_rank, config, timeout_s=60)
    assert all(expected in m for m in messages), messages
