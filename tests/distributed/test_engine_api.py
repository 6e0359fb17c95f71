"""The engine's surface: optimizers given as instances or callables, the full-state accessors,
counters and accessors DeepSpeed users reach for, and `destroy()`."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_params_match


def user_optimizer_and_scheduler(stage: int, as_callable: bool) -> None:
    """A torch optimizer (and a torch LR scheduler built on it) passed in by the user."""
    torch.manual_seed(0)
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(stage, persistence_threshold=0)  # no optimizer: the user's
    if as_callable:
        engine, optimizer, _, scheduler = zerodp.initialize(
            model=model,
            config=config,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        )
    else:
        user_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        user_sched = torch.optim.lr_scheduler.StepLR(user_opt, step_size=2, gamma=0.5)
        engine, optimizer, _, scheduler = zerodp.initialize(
            model=model, config=config, optimizer=user_opt, lr_scheduler=user_sched
        )
        assert scheduler is user_sched
    reference = ReferenceDP(ref_model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    ref_sched = torch.optim.lr_scheduler.StepLR(reference.optimizer, step_size=2, gamma=0.5)
    for step in range(5):
        x = tiny_inputs(dist.get_rank(), step)
        engine.backward(engine(x).square().mean())
        engine.step()
        reference.run_backward(lambda x=x: ref_model(x).square().mean().backward())
        reference.step()
        reference.zero_grad()
        ref_sched.step()
        assert engine.get_lr() == ref_sched.get_last_lr()
        assert_params_match(model, reference, f"stage {stage}, step {step}")
    assert isinstance(optimizer, torch.optim.Optimizer)
    # The optimizer returned is the one that steps: the scheduler sets its lr, and its
    # momentum is the reference SGD's, parameter by parameter.
    assert optimizer is engine.optimizer
    assert [g["lr"] for g in optimizer.param_groups] == ref_sched.get_last_lr()
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(
            zerodp.utils.safe_get_full_optimizer_state(param, "momentum_buffer"),
            reference.optimizer.state[ref_param]["momentum_buffer"],
        )
    engine.destroy()


@pytest.mark.parametrize("as_callable", [False, True], ids=["instance", "callable"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_user_optimizer_and_scheduler(pools, stage: int, as_callable: bool) -> None:
    pools(2).run(user_optimizer_and_scheduler, stage, as_callable)


CLIP = 0.05  # gradient_clipping in `accessors`: below the gradient norm of every step


def accessors(stage: int) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(
        stage,
        optimizer=optimizer_config("Adam", lr=1e-2, adam_w_mode=False),
        persistence_threshold=0,
        clipping=CLIP,
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(ref_model, lambda p: torch.optim.Adam(p, lr=1e-2))
    assert engine.zero_stage == stage
    assert engine.world_size == dist.get_world_size() and engine.global_rank == dist.get_rank()
    assert engine.train_batch_size() == 4 * dist.get_world_size()
    assert engine.gradient_accumulation_steps() == 1
    assert engine.train_micro_batch_size_per_gpu() == 4

    # Set a full value on every rank; the next step starts from it.
    new_value = torch.linspace(-1, 1, model.fc1.weight.numel()).view_as(model.fc1.weight)
    zerodp.utils.safe_set_full_fp32_param(model.fc1.weight, new_value)
    with torch.no_grad():
        ref_model.fc1.weight.copy_(new_value)
    torch.testing.assert_close(zerodp.utils.safe_get_full_fp32_param(model.fc1.weight), new_value)
    for step in range(2):
        x = tiny_inputs(dist.get_rank(), step)
        engine.backward(engine(x).square().mean())
        reference.run_backward(lambda x=x: ref_model(x).square().mean().backward())
        engine.step()
        # The global norm of the averaged gradient, before clipping (which it triggers).
        ref_norm = torch.linalg.vector_norm(
            torch.cat([reference.grad(p).reshape(-1) for p in reference.params])
        ).item()
        assert ref_norm > 2 * CLIP, ref_norm
        norm = engine.get_global_grad_norm()
        assert norm == pytest.approx(ref_norm, rel=1e-5), (stage, step, norm, ref_norm)
        reference.clip(CLIP)
        reference.step()
        reference.zero_grad()
    assert_params_match(model, reference, f"stage {stage} after safe_set_full_fp32_param")
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        state = reference.optimizer.state[ref_param]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                zerodp.utils.safe_get_full_optimizer_state(param, key), state[key]
            )
    assert engine.global_steps == 2 and engine.micro_steps == 2
    assert engine.get_global_grad_norm() is not None
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_state_accessors(pools, stage: int) -> None:
    pools(2).run(accessors, stage)


def destroy_leaves_a_plain_model(stage: int) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    config = zerodp_config(
        stage, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    x = tiny_inputs(dist.get_rank(), 0)
    engine.backward(engine(x).square().mean())
    engine.step()
    trained = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()

    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for param, value in zip(model.parameters(), trained, strict=True):
        assert type(param) is nn.Parameter
        assert param.grad is None
        assert not param._backward_hooks and not param._post_accumulate_grad_hooks
        torch.testing.assert_close(param.detach(), value)  # whole, and as trained
    # Plain PyTorch from here: local gradients, no reduction, no sharding.
    model(x).square().mean().backward()
    plain = copy.deepcopy(model)
    plain.zero_grad()
    plain(x).square().mean().backward()
    for param, plain_param in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param.grad, plain_param.grad)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_destroy_leaves_a_usable_plain_model(pools, stage: int) -> None:
    pools(2).run(destroy_leaves_a_plain_model, stage)
