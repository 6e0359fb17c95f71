"""bf16 and fp16 at every stage against the same recipe written out by hand.

The reference (`ReferenceDP` with a dtype): the model copy in bf16/fp16, each backward's
gradients averaged over ranks with an explicit all_reduce in the model's dtype, fp32 master
weights stepped by AdamW after dividing out the same loss scale, then copied back. zerodp
does exactly these operations (a reduce-scatter sums the same two values as the all-reduce),
so with one micro-batch per step the results are bitwise equal. With accumulation zerodp
keeps gradients in fp32 between micro-batches; the reference mirrors it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.models import TinyNet, tiny_inputs
from zerodp.monitor import ideal_model_state_bytes
from zerodp.testing import ReferenceDP

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BITWISE = {"rtol": 0.0, "atol": 0.0}


def _config(stage: int, dtype: str, gas: int = 1, **fp16: object) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, **fp16}
    return config


def _adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)  # type: ignore[arg-type]


def mixed_parity(stage: int, dtype: str, gas: int, steps: int, init: bool = False) -> None:
    torch.manual_seed(0)
    reference_model = TinyNet()
    if init:  # built already sharded, in fp32; the engine casts it
        torch.manual_seed(0)
        with zerodp.zero.Init(config=_config(stage, dtype, gas)):
            model = TinyNet()
    else:
        model = copy.deepcopy(reference_model)
    reference = ReferenceDP(
        reference_model,
        _adamw,
        dtype=DTYPES[dtype],
        grad_dtype=torch.float32 if gas > 1 else DTYPES[dtype],
        # Stages 0 and 1 sum micro-batches locally and reduce once, at the boundary.
        defer_reduction=gas > 1 and stage in (0, 1),
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, dtype, gas))
    rank = dist.get_rank()
    for step in range(steps):
        scale = engine.loss_scale
        for micro in range(gas):
            x = tiny_inputs(rank, step * gas + micro)
            engine.backward(engine(x).float().square().mean())
            reference.run_backward(
                lambda x=x, scale=scale: (
                    reference.model(x.to(DTYPES[dtype])).float().square().mean() * scale / gas
                ).backward()
            )
            engine.step()
        reference.reduce_local()
        assert reference.step(loss_scale=scale, clip=1.0)
        reference.zero_grad()
        assert engine.skipped_steps == 0
        for name, param in model.named_parameters():
            ref_param = dict(reference.model.named_parameters())[name]
            master = zerodp.utils.safe_get_full_fp32_param(param)
            torch.testing.assert_close(master, reference.master(ref_param), **BITWISE)
            with zerodp.zero.GatheredParameters([param]):
                assert param.dtype == DTYPES[dtype]
                torch.testing.assert_close(param.detach(), ref_param.detach(), **BITWISE)
    engine.destroy()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ten_steps_match_the_hand_written_recipe(pools, stage: int, dtype: str) -> None:
    pools(2).run(mixed_parity, stage, dtype, 1, 10)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_model_built_under_init_trains_like_the_recipe(pools, dtype: str) -> None:
    pools(2).run(mixed_parity, 3, dtype, 1, 3, True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_keeps_fp32_gradients(pools, stage: int) -> None:
    pools(2).run(mixed_parity, stage, "bf16", 4, 3)


def overflow_skips_everywhere(stage: int, hysteresis: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(
        model=model, config=_config(stage, "fp16", hysteresis=hysteresis)
    )
    rank = dist.get_rank()
    poison = {"on": False}

    def inject_inf(grad: torch.Tensor) -> torch.Tensor:
        if poison["on"] and rank == 1:  # one rank only: the decision must still be shared
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model.fc2.weight.register_hook(inject_inf)
    scales, skipped = [], []
    for step in range(2 + hysteresis + 2):
        poison["on"] = 2 <= step < 2 + hysteresis
        before = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
        moments = [
            zerodp.utils.safe_get_full_optimizer_state(p, "exp_avg") for p in model.parameters()
        ]
        engine.backward(engine(tiny_inputs(rank, step)).float().square().mean())
        engine.step()
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
        after = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
        if poison["on"]:  # skipped: weights and optimizer state untouched
            for b, a in zip(before, after, strict=True):
                torch.testing.assert_close(a, b, **BITWISE)
            for p, m in zip(model.parameters(), moments, strict=True):
                now = zerodp.utils.safe_get_full_optimizer_state(p, "exp_avg")
                torch.testing.assert_close(now, m, **BITWISE)
        else:  # and training goes on
            assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    engine.destroy()
    return {"scales": scales, "skipped": skipped}


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_on_one_rank_skips_the_step_everywhere(pools, stage: int, hysteresis: int):
    reports = pools(2).run(overflow_skips_everywhere, stage, hysteresis)
    assert reports[0] == reports[1]
    scales, skipped = reports[0]["scales"], reports[0]["skipped"]
    initial = 2.0**8
    assert skipped[-1] == hysteresis
    # The scale stays put until `hysteresis` overflows were seen, then halves once.
    assert scales[1] == initial
    assert scales[2 + hysteresis - 1] == initial / 2
    if hysteresis > 1:
        assert scales[2] == initial


def loss_scale_floor() -> str:
    torch.manual_seed(0)
    model = TinyNet()
    config = _config(2, "fp16", hysteresis=1, min_loss_scale=64.0)
    config["fp16"]["initial_scale_power"] = 7
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    model.fc2.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    x = tiny_inputs(dist.get_rank(), 0)
    engine.backward(engine(x).float().square().mean())
    engine.step()  # 128 -> 64
    engine.backward(engine(x).float().square().mean())
    with pytest.raises(zerodp.ZeroDPError, match="minimum loss scale") as error:
        engine.step()
    engine.destroy()
    return str(error.value)


def test_overflow_at_the_minimum_loss_scale_is_reported(pools) -> None:
    messages = pools(2).run(loss_scale_floor)
    assert "min_loss_scale" in messages[0]


def mixed_memory(stage: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    num_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, "bf16"))
    engine.backward(engine(torch.randn(2, 128)).float().square().mean())
    engine.step()
    measured = engine.model_state_bytes().total
    engine.destroy()
    return measured, ideal_model_state_bytes(num_params, stage, 2, mixed=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_memory_follows_the_paper(pools, stage: int) -> None:
    measured, ideal = pools(2).run(mixed_memory, stage)[0]
    assert abs(measured - ideal) <= 0.10 * ideal, (measured, ideal)
