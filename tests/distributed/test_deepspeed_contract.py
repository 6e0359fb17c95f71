"""DeepSpeed's backward contract and engine methods, against the data-parallel reference.

The reference (`ReferenceDP`) is a plain model copy per rank, each backward's gradients
averaged with an explicit all_reduce. SGD without momentum is used where a constant factor
matters (Adam would hide a gradient off by the accumulation steps).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import assert_grads_match, assert_params_match

GAS = 4
SGD = optimizer_config("SGD", lr=0.1)


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def _pair(stage: int, gas: int = GAS, **config: object) -> tuple:
    torch.manual_seed(0)
    model = TinyNet()
    reference = ReferenceDP(copy.deepcopy(model), _sgd)
    engine, optimizer, _, _ = zerodp.initialize(
        model=model,
        config=zerodp_config(stage, gas=gas, optimizer=SGD, persistence_threshold=0, **config),
    )
    return engine, optimizer, model, reference


def _run_style(engine: zerodp.ZeroEngine, style: str, loss: torch.Tensor) -> None:
    if style == "engine_backward":
        engine.backward(loss)
    elif style == "loss_backward":
        loss.backward()
    elif style == "scale_backward":
        engine.scale(loss).backward()
    elif style == "undivided":
        engine.backward(loss, scale_wrt_gas=False)
    else:
        raise ValueError(style)


STYLES = ("engine_backward", "loss_backward", "scale_backward", "undivided")


def _reference_backward(reference: ReferenceDP, *inputs: torch.Tensor, factor: float = 1.0) -> None:
    """The reference's backward of factor * (the sum of the square losses of `inputs`)."""

    def run() -> None:
        loss = sum(reference.model(x).square().mean() for x in inputs)
        (loss * factor).backward()  # type: ignore[union-attr]

    reference.run_backward(run)


def call_styles_agree(stage: int) -> int:
    """Every call style with accumulation 4: the gradients DeepSpeed's contract promises."""
    rank = dist.get_rank()
    checks = 0
    for style in STYLES:
        engine, _, model, reference = _pair(stage)
        factor = 1.0 if style == "undivided" else 1.0 / GAS
        for micro in range(2 * GAS):
            x = tiny_inputs(rank, micro)
            _run_style(engine, style, engine(x).square().mean())
            _reference_backward(reference, x, factor=factor)
            assert_grads_match(model, reference, f"stage {stage} {style} micro {micro}")
            checks += 1
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                reference.step()
                reference.zero_grad()
                assert_params_match(model, reference, f"stage {stage} {style} after a step")
        engine.destroy()
    return checks


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_call_style_divides_by_the_accumulation_steps(pools, stage: int) -> None:
    checks = pools(2).run(call_styles_agree, stage)
    assert checks == [len(STYLES) * 2 * GAS] * 2


def scaled_and_unscaled_in_one_backward(stage: int) -> int:
    """`(engine.scale(a) + b).backward()` and the other mixes a loss can be built from: every
    part of the gradient is divided by the accumulation steps, whatever was scaled."""
    rank = dist.get_rank()
    engine, _, model, reference = _pair(stage)
    checks = 0
    mixes: list[Callable[[torch.Tensor, torch.Tensor], None]] = [
        lambda a, b: (engine.scale(a) + b).backward(),
        lambda a, b: (a + engine.scale(b)).backward(),
        lambda a, b: (engine.scale(a) + engine.scale(b)).backward(),
        lambda a, b: torch.autograd.backward([engine.scale(a), b]),
    ]
    for micro in range(2 * GAS):
        first, second = tiny_inputs(rank, 2 * micro), tiny_inputs(rank, 2 * micro + 1)
        a, b = engine(first).square().mean(), engine(second).square().mean()
        mixes[micro % len(mixes)](a, b)
        _reference_backward(reference, first, second, factor=1.0 / GAS)
        assert_grads_match(model, reference, f"stage {stage} mix {micro % len(mixes)}")
        checks += 1
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            reference.step()
            reference.zero_grad()
            assert_params_match(model, reference, f"stage {stage} mixed losses, after a step")
    engine.destroy()
    return checks


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_scaled_and_an_unscaled_loss_in_one_backward_are_divided_alike(pools, stage: int) -> None:
    assert pools(2).run(scaled_and_unscaled_in_one_backward, stage) == [2 * GAS] * 2


def non_scalar_and_two_engines(stage: int) -> None:
    rank = dist.get_rank()
    # A non-scalar backward with an explicit gradient.
    engine, _, model, reference = _pair(stage, gas=1)
    x = tiny_inputs(rank, 0)
    out, ref_out = engine(x), reference.model(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
    out.backward(gradient=grad)
    reference.run_backward(lambda: ref_out.backward(gradient=grad))
    assert_grads_match(model, reference, f"stage {stage}: out.backward(gradient)")
    engine.step()
    reference.step()
    assert_params_match(model, reference, f"stage {stage}: step after a non-scalar backward")
    engine.destroy()

    # Two models, two engines, one loss that combines both outputs.
    engine_a, _, model_a, reference_a = _pair(stage, gas=1)
    torch.manual_seed(1)
    model_b = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    reference_b = ReferenceDP(copy.deepcopy(model_b), _sgd)
    engine_b, _, _, _ = zerodp.initialize(
        model=model_b, config=zerodp_config(stage, optimizer=SGD, persistence_threshold=0)
    )
    for step in range(2):
        x = tiny_inputs(rank, step + 1)
        loss = engine_b(engine_a(x)).square().mean() + engine_a(x).abs().mean()
        ref_loss = (
            reference_b.model(reference_a.model(x)).square().mean()
            + reference_a.model(x).abs().mean()
        )
        loss.backward()
        for param in reference_b.params:
            param.grad = None
        reference_a.run_backward(ref_loss.backward)  # reaches both reference models
        reference_b.collect()
        assert_grads_match(model_a, reference_a, f"stage {stage}: engine a, one joint loss")
        assert_grads_match(model_b, reference_b, f"stage {stage}: engine b, one joint loss")
        for engine, ref in ((engine_a, reference_a), (engine_b, reference_b)):
            engine.step()
            ref.step()
            ref.zero_grad()
        assert_params_match(model_a, reference_a, f"stage {stage}: engine a after a step")
        assert_params_match(model_b, reference_b, f"stage {stage}: engine b after a step")
    engine_a.destroy()
    engine_b.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_non_scalar_backward_and_one_loss_over_two_engines(pools, stage: int) -> None:
    pools(2).run(non_scalar_and_two_engines, stage)


def backward_arguments(stage: int) -> list[str]:
    engine, _, _, _ = _pair(stage, gas=1)
    x = tiny_inputs(dist.get_rank(), 0)
    messages = []
    with pytest.raises(zerodp.UsageError, match="unexpected keyword") as error:
        engine.backward(engine(x).square().mean(), retain_grpah=True)
    messages.append(str(error.value))
    with pytest.raises(zerodp.UsageError, match="scalar") as error:
        engine.scale(engine(x))
    messages.append(str(error.value))
    # DeepSpeed asserts here, and its tests catch AssertionError: so does zerodp's error.
    for call in (engine.scale, engine.backward):
        with pytest.raises(AssertionError, match="scalar"):
            call(engine(x))
    with pytest.raises(zerodp.UsageError, match="grad_fn") as error:
        engine.scale(torch.ones((), requires_grad=True))
    messages.append(str(error.value))
    with pytest.raises(zerodp.UsageError, match="no_sync"):
        engine.backward(engine(x).square().mean(), allreduce_gradients=False)
    loss = engine(x).square().mean()
    scaled = engine.scale(loss, retain_graph=True)  # DeepSpeed's signature, accepted
    scaled.backward()
    engine.step()
    engine.destroy()
    return messages


@pytest.mark.parametrize("stage", [0, 3])
def test_backward_arguments_are_checked_with_zerodp_errors(pools, stage: int) -> None:
    for message in pools(2).run(backward_arguments, stage)[0]:
        assert "backward" in message or "scale" in message, message


# -- zero_grad through every door --------------------------------------------------------


def zero_grad_everywhere(stage: int) -> None:
    """`loss.backward(); optimizer.step(); <door>.zero_grad()` equals the reference."""
    rank = dist.get_rank()
    doors: dict[str, Callable[[zerodp.ZeroEngine, nn.Module, object], None]] = {
        "model": lambda engine, model, optimizer: model.zero_grad(),
        "engine.module": lambda engine, model, optimizer: engine.module.zero_grad(),
        "optimizer": lambda engine, model, optimizer: optimizer.zero_grad(),
    }
    for name, zero_grad in doors.items():
        engine, optimizer, model, reference = _pair(stage, gas=1)
        for step in range(3):
            x = tiny_inputs(rank, step)
            engine(x).square().mean().backward()
            _reference_backward(reference, x)
            optimizer.step()
            reference.step()
            zero_grad(engine, model, optimizer)
            reference.zero_grad()
            assert_params_match(model, reference, f"stage {stage}: {name}.zero_grad(), {step}")
        engine.destroy()
        assert "zero_grad" not in model.__dict__, "destroy() gives the module its own method"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_and_optimizer_zero_grad_clear_what_zerodp_keeps(pools, stage: int) -> None:
    pools(2).run(zero_grad_everywhere, stage)


def step_without_backward_warns(stage: int) -> int:
    engine, _, _, _ = _pair(stage, gas=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.step()
        engine.step()
    engine.destroy()
    return sum("no backward since the last step" in str(w.message) for w in caught)


def test_a_step_with_no_backward_warns_once(pools) -> None:
    assert pools(2).run(step_without_backward_warns, 2) == [1, 1]


# -- engine methods ------------------------------------------------------------------------


def engine_methods(stage: int, directory: str) -> dict:
    rank = dist.get_rank()
    engine, optimizer, model, reference = _pair(
        stage, gas=2, zero={"stage3_gather_16bit_weights_on_model_save": True}
    )
    plain = reference.model
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [tuple(p.shape) for p in engine.parameters()] == [
        tuple(p.shape) for p in plain.parameters()
    ]
    assert engine.zero_optimization_stage() == stage
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.get_data_types() == (torch.float32, torch.float32)
    assert engine.local_rank == rank
    assert not optimizer.needs_scaler() and optimizer.loss_scale == optimizer.cur_scale == 1.0

    # A manual boundary: the first micro-batch steps, as the override says.
    engine.set_gradient_accumulation_boundary(True)
    x = tiny_inputs(rank, 0)
    engine.backward(engine(x).square().mean())
    _reference_backward(reference, x, factor=0.5)
    engine.step()
    reference.step()
    reference.zero_grad()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert_params_match(model, reference, f"stage {stage}: step at a forced boundary")
    engine.set_gradient_accumulation_boundary(None)

    # The global gradient norm of the last step, against the reference's.
    for micro in range(2):
        x = tiny_inputs(rank, 1 + micro)
        engine.backward(engine(x).square().mean())
        _reference_backward(reference, x, factor=0.5)
    expected_norm = torch.nn.utils.get_total_norm(
        [reference.grad(p) for p in plain.parameters()]
    ).item()
    engine.step()
    reference.step()
    reference.zero_grad()
    assert engine.get_global_grad_norm() == pytest.approx(expected_norm, rel=1e-5)

    # state_dict equals the plain module's; load_state_dict of a perturbed one sets it.
    state = engine.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    partial = engine.state_dict(rank0_only=True)  # a collective: every rank calls it
    assert (len(partial) == 0) == (rank != 0)
    new_state = {k: v + 0.5 for k, v in plain.state_dict().items()}
    engine.load_state_dict(new_state)
    plain.load_state_dict(new_state)
    assert_params_match(model, reference, f"stage {stage}: after load_state_dict")
    with pytest.raises(zerodp.CheckpointError, match=r"missing: fc1\.bias"):
        engine.load_state_dict({k: v for k, v in new_state.items() if k != "fc1.bias"})

    # This rank's parts: in rank order they make up the full values.
    results: dict = {}
    pieces = [zerodp.utils.safe_get_local_fp32_param(p) for p in model.parameters()]
    gathered: list[list[torch.Tensor]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, pieces)
    for index, param in enumerate(model.parameters()):
        full = zerodp.utils.safe_get_full_fp32_param(param).reshape(-1)
        if stage == 0:
            torch.testing.assert_close(pieces[index], full)
        else:  # the ranks' parts, in rank order, make up the parameter
            torch.testing.assert_close(torch.cat([g[index] for g in gathered]), full)

    # save_16bit_model writes what the plain module holds.
    saved = engine.save_16bit_model(directory, "model.pt")
    results["saved"] = saved
    if rank == 0:
        loaded = torch.load(Path(directory) / "model.pt", weights_only=True)
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(loaded[key], value, rtol=1e-5, atol=1e-6)
    engine.destroy()
    return results


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_methods_deepspeed_users_call(pools, tmp_path, stage: int) -> None:
    results = pools(2).run(engine_methods, stage, str(tmp_path))
    assert all(r["saved"] for r in results), results


def no_sync_and_16bit_save_rules(stage: int, directory: str) -> str:
    rank = dist.get_rank()
    engine, _, model, reference = _pair(stage, gas=2)
    if stage in (2, 3):
        with pytest.raises(zerodp.UsageError, match="no_sync") as error, engine.no_sync():
            pass
        message = str(error.value)
    else:
        # Inside no_sync: local sums only; the boundary backward after it reduces them all.
        with engine.no_sync():
            x = tiny_inputs(rank, 0)
            engine.backward(engine(x).square().mean())
            engine.step()  # not a boundary: counts the micro-step
            x2 = tiny_inputs(rank, 1)
            engine.backward(engine(x2).square().mean())
            with pytest.raises(zerodp.LifecycleError, match="no_sync"):
                engine.step()
        engine.step()
        _reference_backward(reference, x, x2, factor=0.5)
        reference.step()
        assert_params_match(model, reference, f"stage {stage}: a window under no_sync()")
        message = ""
    if stage == 3:  # without the flag, stage 3 does not gather for a 16-bit save
        assert engine.save_16bit_model(directory, "none.pt") is False
        assert not (Path(directory) / "none.pt").exists()
    engine.destroy()
    return message


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_and_the_16bit_save_flag(pools, tmp_path, stage: int) -> None:
    messages = pools(2).run(no_sync_and_16bit_save_rules, stage, str(tmp_path))
    if stage in (2, 3):
        assert all("gradient_accumulation_steps" in m for m in messages)


def tied_state_and_scheduler(stage: int) -> None:
    from tests.models import TiedLM, token_inputs

    torch.manual_seed(0)
    model = TiedLM()
    engine, _, _, _ = zerodp.initialize(
        model=model,
        config=zerodp_config(stage, optimizer=SGD, persistence_threshold=0),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
    )
    state = engine.state_dict()
    assert state["embed.weight"] is state["head.weight"], "tied names share one tensor"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if it thinks the scheduler stepped first
        for step in range(2):
            engine.backward(engine(token_inputs(dist.get_rank(), step)).square().mean())
            engine.step()
    assert engine.get_lr() == [pytest.approx(0.1 * 0.25)]
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_tied_state_dict_entries_and_torch_schedulers(pools, stage: int) -> None:
    pools(2).run(tied_state_and_scheduler, stage)
