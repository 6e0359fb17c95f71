"""Contracts of the engine's wiring: the fp16 scale follows the graph, a failed load changes
nothing, every rank raises the same error, one model has one engine.

Gradients are compared with the data-parallel reference computed in the test (`ReferenceDP`:
a plain model copy per rank, each backward's gradients averaged with an explicit all_reduce),
written out in fp16 with the loss scale applied to the reference's loss.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.models import TinyNet, tiny_inputs
from zerodp.comm import Comm
from zerodp.testing import ReferenceDP

FP16_TOLERANCE = {"rtol": 2e-3, "atol": 1e-5}


def _config(stage: int, *, fp16: bool = False, lr: float = 0.1) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    return config


def _fp16_pair(stage: int) -> tuple[zerodp.ZeroEngine, torch.nn.Module, ReferenceDP]:
    torch.manual_seed(0)
    model = TinyNet()
    reference = ReferenceDP(copy.deepcopy(model), dtype=torch.float16)
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, fp16=True))
    return engine, model, reference


def _assert_grads_equal_reference(
    model: torch.nn.Module, reference: ReferenceDP, loss_scale: float, where: str
) -> None:
    for (name, param), ref_param in zip(
        model.named_parameters(), reference.model.parameters(), strict=True
    ):
        full = zerodp.utils.safe_get_full_grad(param)
        expected = reference.grad(ref_param).float() / loss_scale
        torch.testing.assert_close(
            full.float(), expected, **FP16_TOLERANCE, msg=lambda m, n=name: f"{where} {n}: {m}"
        )


def fp16_scaled_loss_reused(stage: int) -> None:
    """`s = scale(loss)` run backward twice: each backward carries the scale once."""
    engine, model, reference = _fp16_pair(stage)
    scale = engine.loss_scale
    assert scale == 16.0
    x = tiny_inputs(dist.get_rank(), 0)
    scaled = engine.scale(engine(x.half()).float().square().mean())
    ref_loss = reference.model(x.half()).float().square().mean()
    engine.zero_grad()
    scaled.backward(retain_graph=True)
    reference.run_backward(lambda: (ref_loss * scale).backward(retain_graph=True))
    _assert_grads_equal_reference(model, reference, scale, "first backward")
    first = [zerodp.utils.safe_get_full_grad(p) for p in model.parameters()]
    engine.zero_grad()
    reference.zero_grad()
    scaled.backward()
    reference.run_backward((ref_loss * scale).backward)
    _assert_grads_equal_reference(model, reference, scale, "second backward")
    second = [zerodp.utils.safe_get_full_grad(p) for p in model.parameters()]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "the same scaled loss twice must give the same gradients"
    engine.destroy()


def fp16_scale_without_backward(stage: int) -> None:
    """`scale()` for logging, then a plain `loss.backward()`: the scale is applied once."""
    engine, model, reference = _fp16_pair(stage)
    scale = engine.loss_scale
    x = tiny_inputs(dist.get_rank(), 1)
    loss = engine(x.half()).float().square().mean()
    ref_loss = reference.model(x.half()).float().square().mean()
    logged = engine.scale(loss)  # e.g. for logging: never run backward through
    assert logged.requires_grad and logged is not loss
    loss.backward()
    reference.run_backward((ref_loss * scale).backward)
    _assert_grads_equal_reference(model, reference, scale, "plain backward after scale()")
    engine.destroy()


def fp16_scaled_loss_not_at_the_root(stage: int) -> str:
    """Under fp16 a scaled loss reached from another root would leave part of the gradient
    unscaled: the backward raises on every rank, and the engine trains on exactly after."""
    engine, model, reference = _fp16_pair(stage)
    scale = engine.loss_scale
    rank = dist.get_rank()
    a = engine(tiny_inputs(rank, 0).half()).float().square().mean()
    b = engine(tiny_inputs(rank, 1).half()).float().square().mean()
    try:
        (engine.scale(a) + b).backward()
    except zerodp.UsageError as error:
        message = str(error)
    else:
        raise AssertionError("a mixed fp16 backward did not raise")
    x = tiny_inputs(rank, 2)
    engine.zero_grad()
    engine.backward(engine(x.half()).float().square().mean())
    ref_loss = reference.model(x.half()).float().square().mean()
    reference.run_backward((ref_loss * scale).backward)
    _assert_grads_equal_reference(model, reference, scale, "a backward after the refused one")
    engine.destroy()
    return message


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_scaled_loss_must_be_the_root_of_its_backward(pools, stage: int) -> None:
    messages = pools(2).run(fp16_scaled_loss_not_at_the_root, stage)
    assert len(set(messages)) == 1
    assert "Call .backward() on the scaled loss itself" in messages[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_loss_scale_follows_the_graph_not_the_call_order(pools, stage: int) -> None:
    pools(2).run(fp16_scaled_loss_reused, stage)
    pools(2).run(fp16_scale_without_backward, stage)


# -- a failed load changes nothing ---------------------------------------------------------


def _snapshot(engine: zerodp.ZeroEngine, model: torch.nn.Module) -> dict:
    return {
        "params": [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()],
        "momentum": [
            zerodp.utils.safe_get_full_optimizer_state(p, "momentum_buffer")
            for p in model.parameters()
        ],
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
        "lr": engine.get_lr(),
    }


def _train(engine: zerodp.ZeroEngine, steps: int, seed: int) -> None:
    for step in range(steps):
        engine.backward(engine(tiny_inputs(dist.get_rank(), seed + step)).square().mean())
        engine.step()


def _two_group_engine(stage: int) -> tuple[zerodp.ZeroEngine, torch.nn.Module]:
    torch.manual_seed(1)
    model = TinyNet()
    groups = [
        {"params": list(model.fc1.parameters())},
        {"params": [*model.norm.parameters(), *model.fc2.parameters()], "lr": 0.5},
    ]
    config = _config(stage)
    config["optimizer"]["params"]["momentum"] = 0.9
    engine, _, _, _ = zerodp.initialize(model=model, config=config, model_parameters=groups)
    return engine, model


def failed_load_changes_nothing(stage: int, directory: str) -> list[str]:
    torch.manual_seed(0)
    config = _config(stage)
    config["optimizer"]["params"]["momentum"] = 0.9
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=config)
    _train(engine, 3, seed=0)
    engine.save_checkpoint(directory, tag="one_group")
    engine.destroy()

    engine, model = _two_group_engine(stage)
    _train(engine, 1, seed=10)
    before = _snapshot(engine, model)
    messages = []
    with pytest.raises(zerodp.CheckpointError) as error:
        engine.load_checkpoint(directory, tag="one_group")
    messages.append(str(error.value))
    after = _snapshot(engine, model)
    assert after["counters"] == before["counters"] and after["lr"] == before["lr"]
    for a, b in zip(
        before["params"] + before["momentum"], after["params"] + after["momentum"], strict=True
    ):
        assert torch.equal(a, b), "a refused load must not change weights or optimizer state"

    if dist.get_rank() == 0:  # a damaged counter is refused before anything is read too
        state_file = Path(directory) / "one_group" / "zerodp_state.json"
        shared = json.loads(state_file.read_text())
        shared["counters"]["global_steps"] = "abc"
        state_file.write_text(json.dumps(shared))
    dist.barrier()
    with pytest.raises(zerodp.CheckpointError) as error:
        # Not verified: a hand edit also breaks the file's checksum, which would refuse it first.
        engine.load_checkpoint(
            directory, tag="one_group", load_optimizer_states=False, verify_checksums=False
        )
    messages.append(str(error.value))
    again = _snapshot(engine, model)
    for a, b in zip(before["params"], again["params"], strict=True):
        assert torch.equal(a, b)
    assert again["counters"] == before["counters"]
    _train(engine, 1, seed=20)  # and the engine still trains
    engine.destroy()
    return messages


@pytest.mark.parametrize("stage", [1, 3])
def test_a_refused_load_leaves_the_engine_untouched(pools, tmp_path, stage: int) -> None:
    messages = pools(2).run(failed_load_changes_nothing, stage, str(tmp_path / f"s{stage}"))
    for rank_messages in messages:
        assert "2 optimizer param groups" in rank_messages[0] or "1 optimizer" in rank_messages[0]
        assert "global_steps" in rank_messages[1]
    assert messages[0] == messages[1], "every rank must report the same error"


# -- one agreed error on every rank -------------------------------------------------------


class _LocalOnlyError(Exception):
    """An exception type zerodp does not know (it must not be re-created by name)."""


def agreed_errors(tmp: str) -> list[tuple[str, str]]:
    comm = Comm()
    rank = dist.get_rank()
    seen = []
    cases: list[BaseException | None] = [
        PermissionError("disk of rank 1 is read-only") if rank == 1 else None,
        zerodp.CheckpointError("bad file on rank 1") if rank == 1 else None,
        _LocalOnlyError("something rank-local") if rank == 1 else None,
    ]
    for error in cases:
        with pytest.raises(Exception) as caught:
            comm.raise_if_any_failed(error)
        seen.append((type(caught.value).__name__, str(caught.value)))
    # Through the public API: only rank 1's save target is unwritable.
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(2))
    target = "/sys/not-writable" if rank == 1 else tmp
    with pytest.raises(zerodp.CheckpointStorageError) as caught:
        engine.save_checkpoint(target)
    seen.append((type(caught.value).__name__, str(caught.value)))
    _train(engine, 1, seed=0)  # nobody is left waiting: the next collective still matches
    engine.destroy()
    return seen


def test_every_rank_raises_the_same_error_after_one_rank_fails(pools, tmp_path) -> None:
    per_rank = pools(2).run(agreed_errors, str(tmp_path))
    assert per_rank[0] == per_rank[1], per_rank
    kinds = [kind for kind, _ in per_rank[0]]
    assert kinds == ["PermissionError", "CheckpointError", "AgreedError", "CheckpointStorageError"]
    assert all(message.startswith("rank 1: ") for _, message in per_rank[0])
    local_only = per_rank[0][2][1]
    assert "_LocalOnlyError" not in local_only and "something rank-local" in local_only


# -- one model, one engine -----------------------------------------------------------------


def second_engine_is_refused(stage: int) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage))
    with pytest.raises(zerodp.LifecycleError, match=r"destroy\(\)"):
        zerodp.initialize(model=model, config=_config(stage))
    before = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    _train(engine, 1, seed=0)  # the first engine still owns and trains the model
    after = [zerodp.utils.safe_get_full_fp32_param(p) for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    if stage == 3:  # an unbalanced release is an error, not something to clamp away
        gather = engine.params.sharded_states[0].gather
        assert gather is not None
        with pytest.raises(zerodp.ParamStateError, match="more often than held"):
            gather.unhold()
    engine.destroy()
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage))  # now it may
    _train(engine, 1, seed=1)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_with_a_live_engine_cannot_get_a_second(pools, stage: int) -> None:
    pools(2).run(second_engine_is_refused, stage)
