"""Optimizers that read whole tensors (Muon, Adafactor) against the same torch optimizer in one
process, at every stage: weights after every step and the reassembled optimizer state after the
last, within 1e-6 (fp32).

The reference is computed in the test: a plain model copy per rank whose gradients are
averaged by an explicit all_reduce (`ReferenceDP`), stepped by the same torch optimizer(s) on
whole tensors, identically on every rank (that is the single-process optimizer run on the
averaged gradient). Each case builds a fresh engine in the same worker processes, so the whole
product runs in one spawn per world size.

ZERODP_TENSORWISE_FULL=1 runs the whole product: stages 0-3 x accumulation 1 and 4 x zero.Init
on/off x optimizer offload on/off (offload needs stages 1-3) x Adafactor, Muon + AdamW handed as
a list and the config's DeepSpeed-style "Muon", at world sizes 2 and 3 (168 cases), plus the
cases below (180 in all, about 1.5 minutes here). The default run takes every stage x
accumulation for Adafactor and the list, each once plain and once with zero.Init and offload
together, and the config recipe on four. bf16 (the fp32 masters against the reference's
hand-written recipe, at the mixed-precision tolerance) runs at world size 2 for every stage.
Muon's Newton-Schulz runs in fp32 on both sides here (see
`tests.tensorwise_setup.newton_schulz_fp32` for why); torch's own bf16 iteration is checked
where zerodp sums the gradients in the reference's order (world size 2, one micro-batch), to
the bit.
"""

from __future__ import annotations

import copy
import itertools
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import zerodp_config
from tests.tensorwise_setup import (
    MUON_LR,
    RECIPES,
    WEIGHT_DECAY,
    LayoutNet,
    layout_facts,
    layout_inputs,
    layout_loss,
    newton_schulz,
)
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import MIXED_TOLERANCE as _MIXED

TOLERANCE = 1e-6
MIXED_TOLERANCE = dict(_MIXED[torch.bfloat16])
STEPS = 3
FULL = os.environ.get("ZERODP_TENSORWISE_FULL") == "1"


@dataclass(frozen=True)
class Case:
    recipe: str
    stage: int
    gas: int
    init: bool
    offload: bool
    ns: str = "fp32"  # Muon's Newton-Schulz precision on both sides
    dtype: str = "fp32"  # bf16: the fp32 masters against the reference's hand-written recipe

    @property
    def label(self) -> str:
        return (
            f"{self.recipe} stage {self.stage} gas {self.gas} init={self.init} "
            f"offload={self.offload} ns={self.ns} {self.dtype}"
        )

    @property
    def tolerance(self) -> dict[str, float]:
        """fp32: 1e-6. bf16: the tolerance every mixed-precision parity test uses."""
        return {"atol": TOLERANCE, "rtol": 0.0} if self.dtype == "fp32" else MIXED_TOLERANCE


def _product(recipe: str) -> list[Case]:
    return [
        Case(recipe, stage, gas, init, offload)
        for stage, gas, init, offload in itertools.product(
            range(4), (1, 4), (False, True), (False, True)
        )
        if not (offload and stage == 0)  # optimizer offload moves a shard: stages 1-3
    ]


def cases(world_size: int) -> list[Case]:
    recipes = ("adafactor", "muon_list", "muon_config")
    if FULL:
        chosen = [case for recipe in recipes for case in _product(recipe)]
    else:
        chosen = [
            c
            for c in _product("adafactor") + _product("muon_list")
            if c.init == c.offload or (c.stage == 0 and c.init)
        ]
        chosen += [c for c in _product("muon_config") if c.gas == 4 and c.init != c.offload]
    if world_size == 2:  # zerodp's summation order is the reference's: stock bf16, to the bit
        chosen += [Case("muon_list", stage, 1, False, False, ns="bf16") for stage in range(4)]
        chosen += [
            Case(recipe, stage, 2, False, False, dtype="bf16")
            for recipe in ("adafactor", "muon_list")
            for stage in range(4)
        ]
    return chosen


def _config(case: Case, recipe_config: dict[str, Any] | None) -> dict[str, Any]:
    zero: dict[str, Any] = {}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if case.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return zerodp_config(
        case.stage,
        gas=case.gas,
        optimizer=recipe_config,
        dtype=case.dtype,
        persistence_threshold=0,
        zero=zero,
    )


def _build(case: Case) -> tuple[zerodp.ZeroEngine, torch.nn.Module, ReferenceDP]:
    recipe = RECIPES[case.recipe]
    torch.manual_seed(0)
    reference_model = LayoutNet()
    _, recipe_config = recipe.for_engine(reference_model)  # the config entry only
    config = _config(case, recipe_config)
    torch.manual_seed(0)
    if case.init:
        with zerodp.zero.Init(config=config):
            model = LayoutNet()
    else:
        model = LayoutNet()
    optimizer, _ = recipe.for_engine(model)
    engine, _, _, _ = zerodp.initialize(model=model, config=config, optimizer=optimizer)
    mixed = case.dtype == "bf16"
    reference = ReferenceDP(
        reference_model,
        lambda params: recipe.for_reference(list(params)),
        dtype=torch.bfloat16 if mixed else torch.float32,
        # zerodp keeps accumulated gradients in fp32, one micro-batch's in the model's dtype
        grad_dtype=torch.float32 if case.gas > 1 or not mixed else torch.bfloat16,
        defer_reduction=case.stage in (0, 1) and case.gas > 1,
    )
    return engine, model, reference


def _excess(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 0.0) -> float:
    """max |actual - expected| - rtol |expected|: within `atol` when at most `atol`."""
    if not expected.numel():
        return 0.0
    return ((actual - expected).abs() - rtol * expected.abs()).max().item()


def _max_weight_error(model: torch.nn.Module, reference: ReferenceDP, rtol: float = 0.0) -> float:
    """Over every parameter: the fp32 values (the masters under bf16) against the reference's."""
    worst = 0.0
    for param, ref_param in zip(model.parameters(), reference.model.parameters(), strict=True):
        full = zerodp.utils.safe_get_full_fp32_param(param)
        worst = max(worst, _excess(full, reference.master(ref_param), rtol))
    return worst


def _max_state_error(
    model: torch.nn.Module, reference: ReferenceDP, rtol: float = 0.0
) -> tuple[float, int]:
    """(largest difference, number of state tensors compared) over every state key."""
    worst, compared = 0.0, 0
    stepper = reference.optimizer
    for param, ref_param in zip(model.parameters(), reference.model.parameters(), strict=True):
        stepped = reference.stepped[id(ref_param)]  # the master under bf16
        for key, expected in stepper.state_of(stepped).items():  # type: ignore[union-attr]
            if not isinstance(expected, torch.Tensor):
                continue
            actual = zerodp.utils.safe_get_full_optimizer_state(param, key)
            if actual is None:  # every rank sees the same (a collective answer)
                worst = float("inf")
                continue
            actual = actual.reshape(expected.shape).to(expected.dtype)
            worst = max(worst, _excess(actual, expected, rtol))
            compared += 1
    return worst, compared


def _train(
    engine: zerodp.ZeroEngine, reference: ReferenceDP, gas: int, steps: int, rtol: float = 0.0
) -> list[float]:
    """`steps` optimizer steps on both sides; the weight error after each."""
    rank, errors = dist.get_rank(), []
    model = engine.module
    for step in range(steps):
        for micro in range(gas):
            x = layout_inputs(rank, step, micro)
            engine.backward(layout_loss(engine(x).float()))
            reference.run_backward(
                lambda x=x: (  # type: ignore[misc]
                    layout_loss(reference.model(x.to(reference.dtype)).float()) / gas
                ).backward()
            )
            engine.step()
        if reference.defer_reduction:
            reference.reduce_local()
        reference.step()
        reference.zero_grad()
        errors.append(_max_weight_error(model, reference, rtol))
    return errors


def _run_case(case: Case) -> dict[str, Any]:
    with newton_schulz(case.ns):
        engine, model, reference = _build(case)
        rtol = case.tolerance["rtol"]
        initial = _max_weight_error(model, reference)
        errors = _train(engine, reference, case.gas, STEPS, rtol)
        state_error, compared = _max_state_error(model, reference, rtol)
        facts = layout_facts(engine) if case.stage else {}
        whole = engine.optimizer.torch_optimizers.tensorwise
        engine.destroy()
    return {
        "case": case,
        "initial": initial,
        "errors": errors,
        "state_error": state_error,
        "states_compared": compared,
        "facts": facts,
        "whole": whole is not None,
    }


def run_cases(chosen: list[Case]) -> list[dict[str, Any]]:
    return [_run_case(case) for case in chosen]


@pytest.mark.parametrize("world_size", [2, 3])
def test_whole_tensor_optimizers_match_one_process(pools: Any, world_size: int) -> None:
    chosen = cases(world_size)
    results = pools(world_size).run(run_cases, chosen, timeout_s=900)
    for result in results[0]:
        case: Case = result["case"]
        assert result["whole"], f"{case.label}: no optimizer stepped whole tensors"
        assert result["initial"] == 0.0, f"{case.label}: the models start apart"
        atol = case.tolerance["atol"]
        for step, error in enumerate(result["errors"]):
            assert error <= atol, f"{case.label}: step {step}: weights off by {error:.3g}"
        assert result["state_error"] <= atol, (
            f"{case.label}: optimizer state off by {result['state_error']:.3g}"
        )
        assert result["states_compared"] >= 7, f"{case.label}: state not compared"
        if case.ns == "bf16":
            assert max(result["errors"]) == 0.0, f"{case.label}: stock Muon is not bitwise"
    # Every layout case the step must handle occurred in the real layouts of this run.
    seen: dict[str, bool] = {}
    for result in results[0]:
        for fact, held in result["facts"].items():
            seen[fact] = seen.get(fact, False) or held
    expected = {"straddles": True, "vector_between": True}
    if world_size == 3:
        expected |= {"rank_inside": True, "rank_without_matrix": True}
    assert {k: seen.get(k) for k in expected} == expected, seen


def newton_schulz_count(stage: int, gas: int) -> dict[str, int]:
    """Newton-Schulz calls made inside engine.step() over all ranks, for Muon + AdamW."""
    calls = [0]
    case = Case("muon_list", stage, gas, False, False, ns="bf16")
    engine, _, _ = _build(case)
    rank = dist.get_rank()
    for step in range(STEPS):
        for micro in range(gas):
            engine.backward(layout_loss(engine(layout_inputs(rank, step, micro))))
            with newton_schulz("bf16", calls):
                engine.step()
    engine.destroy()
    total = torch.tensor([calls[0]])
    dist.all_reduce(total)
    return {"rank": calls[0], "total": int(total.item())}


@pytest.mark.parametrize("world_size", [2, 3])
def test_newton_schulz_runs_once_per_matrix_per_step(pools: Any, world_size: int) -> None:
    matrices = 3  # a.weight, head.weight, proj.weight
    for stage in range(4):
        for gas in (1, 4):
            counts = pools(world_size).run(newton_schulz_count, stage, gas)
            label = f"stage {stage}, gas {gas}"
            if stage == 0:  # every rank steps every matrix
                assert all(c["rank"] == matrices * STEPS for c in counts), (label, counts)
            else:
                assert counts[0]["total"] == matrices * STEPS, (label, counts)


def fragment_control() -> dict[str, float]:
    """One Muon step on a matrix that straddles two shards, three ways: zerodp's, the
    reference's (the whole matrix), and Muon stepped on each rank's local fragment of it (what
    an engine that steps flat shards would do, each fragment taken as whole rows or one row)."""
    case = Case("muon_list", 2, 1, False, False, ns="bf16")
    with newton_schulz(case.ns):
        engine, model, reference = _build(case)
        plan = engine.optimizer.torch_optimizers.tensorwise.plan  # type: ignore[union-attr]
        task = next(t for t in plan.tasks if len(t.shape) == 2 and len(t.fragments) >= 2)
        param = dict(model.named_parameters())[task.name]
        ref_param = dict(reference.model.named_parameters())[task.name]
        before = ref_param.detach().clone()
        rank = dist.get_rank()
        x = layout_inputs(rank, 0, 0)
        engine.backward(layout_loss(engine(x)))
        reference.run_backward(lambda: layout_loss(reference.model(x)).backward())
        engine.step()
        grad = reference.grad(ref_param).clone()
        reference.step()
        pieces = []
        for fragment in task.fragments:
            rows = task.shape[1]
            numel = fragment.end - fragment.start
            shape = (numel // rows, rows) if numel % rows == 0 else (1, numel)
            piece = torch.nn.Parameter(before.view(-1)[fragment.start : fragment.end].view(shape))
            piece.grad = grad.view(-1)[fragment.start : fragment.end].view(shape).clone()
            torch.optim.Muon([piece], lr=MUON_LR, weight_decay=WEIGHT_DECAY).step()
            pieces.append(piece.detach().reshape(-1))
        fragment_wise = torch.cat(pieces).view(task.shape)
        expected = ref_param.detach()
        result = {
            "zerodp": (zerodp.utils.safe_get_full_fp32_param(param) - expected).abs().max().item(),
            "fragments": (fragment_wise - expected).abs().max().item(),
            "num_fragments": len(task.fragments),
        }
        engine.destroy()
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_on_local_fragments_is_detectably_wrong(pools: Any, world_size: int) -> None:
    """The negative control: the same setup, stepped fragment by fragment, fails the test's
    tolerance by orders of magnitude, while zerodp's step passes it."""
    result = pools(world_size).run(fragment_control)[0]
    assert result["num_fragments"] >= 2
    assert result["zerodp"] <= TOLERANCE, result
    assert result["fragments"] > 100 * TOLERANCE, result


class NormalizedSGD(torch.optim.Optimizer):
    """Each tensor moves by lr along its gradient's direction: reads the whole tensor's norm,
    so a flat shard would see another update. zerodp does not know the class."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


@zerodp.declare_elementwise
class SignSGD(torch.optim.Optimizer):
    """Each element moves by lr against its gradient's sign (Lion-like): declared elementwise."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


PATH_CASES: dict[str, tuple[Any, bool]] = {
    # name: (optimizer class or factory, steps whole tensors)
    "adamw": (lambda params: torch.optim.AdamW(params, lr=1e-2), False),
    "unknown_normalized_sgd": (NormalizedSGD, True),
    "declared_sign_sgd": (SignSGD, False),
    "adafactor_from_callable": (lambda params: torch.optim.Adafactor(params, lr=1e-2), True),
    "adamw_from_callable": (lambda params: torch.optim.AdamW(params, lr=1e-2), False),
}


def path_cases() -> dict[str, dict[str, Any]]:
    out = {}
    for name, (make, whole) in PATH_CASES.items():
        torch.manual_seed(0)
        model = LayoutNet()
        reference = ReferenceDP(copy.deepcopy(model), make)
        given = make if name.endswith("_callable") else make(model.parameters())
        config = zerodp_config(2, persistence_threshold=0)
        engine, _, _, _ = zerodp.initialize(model=model, config=config, optimizer=given)
        errors = _train(engine, reference, 1, 2)
        out[name] = {
            "whole": engine.optimizer.torch_optimizers.tensorwise is not None,
            "error": max(errors),
        }
        out[name]["expected_whole"] = whole
        engine.destroy()
    return out


def refusals() -> dict[str, str]:
    """The error each rank raises for an optimizer or setting zerodp cannot step."""
    found = {}
    attempts: dict[str, tuple[Any, dict[str, Any]]] = {
        "lbfgs": (lambda m: torch.optim.LBFGS(m.parameters()), {}),
        "sparse_adam": (lambda m: torch.optim.SparseAdam(m.parameters()), {}),
        "muon_nvme": (
            lambda m: torch.optim.Adafactor(m.parameters()),
            {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/zerodp-unused"}},
        ),
    }
    for name, (make, zero) in attempts.items():
        model = LayoutNet()
        config = zerodp_config(2, zero=zero)
        try:
            zerodp.initialize(model=model, config=config, optimizer=make(model))
        except (TypeError, ValueError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def test_path_follows_the_optimizer_class(pools: Any) -> None:
    """torch's elementwise classes and declared ones step flat shards; the rest whole tensors,
    a class zerodp does not know included, exact either way (world size 3, stage 2)."""
    for rank_result in pools(3).run(path_cases):
        for name, result in rank_result.items():
            assert result["whole"] == result["expected_whole"], (name, result)
            assert result["error"] <= TOLERANCE, (name, result)


def test_what_cannot_be_stepped_is_refused_on_every_rank(pools: Any) -> None:
    results = pools(2).run(refusals)
    assert results[0] == results[1]
    for name, refused in (("lbfgs", "LBFGS"), ("sparse_adam", "SparseAdam")):
        message = results[0][name]
        assert f"TypeError: zerodp cannot step {refused}" in message, results
        assert "use AdamW, SGD, or another torch optimizer" in message, results
    assert "NVMe optimizer offload does not support" in results[0]["muon_nvme"], results
    assert '"device": "cpu"' in results[0]["muon_nvme"], results
