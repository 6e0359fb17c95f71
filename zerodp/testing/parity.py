"""Comparing a zerodp-trained model with the data-parallel reference, parameter by parameter.

Every function here is a collective (the full values are assembled from the shards), so
every rank calls it at the same point. Parameters are paired by position and their names
must agree, so a comparison never silently pairs up two different parameters.

fp32 runs are compared at `FP32_TOLERANCE`. Under bf16/fp16 the reference
(`ReferenceDP` with a dtype) writes zerodp's recipe out by hand, and three things can be
compared: the full gradient (the reference keeps its gradients loss-scaled; zerodp's
accessor returns them unscaled, in fp32), the fp32 master weights, and the model's own
bf16/fp16 parameters. Their default tolerance is `MIXED_TOLERANCE` of the dtype; a test
whose reference does exactly zerodp's operations asks for `BITWISE`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from zerodp import utils, zero
from zerodp.testing.reference import ReferenceDP

FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# zerodp and the hand-written mixed recipe do the same operations; the tolerance covers the
# one place they may round differently: a plain fp16 loss.backward() gets the loss scale
# applied to its gradients (in zerodp) rather than to its loss (in the reference).
MIXED_TOLERANCE = {
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 1e-5},
}
BITWISE = {"rtol": 0.0, "atol": 0.0}


def default_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """The tolerance for a model trained in `dtype` (the reference's dtype)."""
    if dtype == torch.float32:
        return dict(FP32_TOLERANCE)
    return dict(MIXED_TOLERANCE[dtype])


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: dict[str, float]) -> None:
    def describe(message: str) -> str:
        return f"{what}: {message}"

    torch.testing.assert_close(
        actual.cpu(), expected.cpu(), rtol=tol["rtol"], atol=tol["atol"], msg=describe
    )


def _pairs(
    model: nn.Module, reference: ReferenceDP, where: str, trainable_only: bool
) -> Iterator[tuple[str, nn.Parameter, nn.Parameter]]:
    """(name, zerodp parameter, reference parameter), in registration order."""
    for (name, param), (ref_name, ref_param) in zip(
        model.named_parameters(), reference.model.named_parameters(), strict=True
    ):
        if name != ref_name:
            raise AssertionError(f"{where}: parameter {name!r} paired with {ref_name!r}")
        if trainable_only and not ref_param.requires_grad:
            continue
        yield name, param, ref_param


def assert_grads_match(
    model: nn.Module,
    reference: ReferenceDP,
    where: str,
    *,
    loss_scale: float = 1.0,
    **tolerance: float,
) -> None:
    """Every full gradient of `model` equals the reference's kept gradient.

    Under mixed precision the reference's gradients are loss-scaled and in the model's (or
    the accumulation) dtype: they are compared in fp32 after dividing out `loss_scale`,
    the scale their losses were multiplied by (zerodp's accessor returns unscaled fp32
    gradients). A parameter zerodp holds no gradient for must have a zero reference one.
    While a deferred reduction holds local sums (`ReferenceDP(defer_reduction=True)` between
    accumulation boundaries), the reference side is those sums averaged over ranks now
    (`ReferenceDP.reduced_grad`), so the comparison is made there too.
    """
    tol = {**default_tolerance(reference.dtype), **tolerance}
    if not reference.mixed and loss_scale != 1.0:
        raise ValueError("an fp32 reference is never loss-scaled")
    for name, param, ref_param in _pairs(model, reference, where, trainable_only=True):
        full = utils.safe_get_full_grad(param)
        expected = reference.reduced_grad(ref_param)
        if reference.mixed:
            expected = expected.float() / loss_scale
        if full is None:
            full = torch.zeros_like(expected)
        if reference.mixed:
            full = full.float()
        _close(full, expected, f"{where}: grad of {name}", tol)


def assert_params_match(
    model: nn.Module, reference: ReferenceDP, where: str, **tolerance: float
) -> None:
    """Every full parameter of `model` (frozen ones too) equals the reference model's (fp32)."""
    tol = {**FP32_TOLERANCE, **tolerance}
    for name, param, ref_param in _pairs(model, reference, where, trainable_only=False):
        full = utils.safe_get_full_fp32_param(param)
        _close(full, ref_param.detach().float(), f"{where}: value of {name}", tol)


def assert_masters_match(
    model: nn.Module, reference: ReferenceDP, where: str, **tolerance: float
) -> None:
    """Every trained parameter's fp32 master equals the reference's (the tensor it steps).

    Under mixed precision these are the fp32 copies the optimizer updates, so they show a
    difference the bf16/fp16 model would round away. Frozen parameters have no master.
    """
    tol = {**default_tolerance(reference.dtype), **tolerance}
    for name, param, ref_param in _pairs(model, reference, where, trainable_only=True):
        master = utils.safe_get_full_fp32_param(param)
        _close(master, reference.master(ref_param), f"{where}: master of {name}", tol)


def assert_working_params_match(
    model: nn.Module, reference: ReferenceDP, where: str, **tolerance: float
) -> None:
    """Every parameter of `model`, gathered, has the reference model's dtype and value.

    Under mixed precision this is the bf16/fp16 copy the forward computes with, which
    zerodp refreshes from the masters after each step (the reference copies them back).
    """
    tol = {**default_tolerance(reference.dtype), **tolerance}
    for name, param, ref_param in _pairs(model, reference, where, trainable_only=False):
        with zero.GatheredParameters([param]):
            if param.dtype != ref_param.dtype:
                raise AssertionError(
                    f"{where}: {name} is {param.dtype}, the reference's is {ref_param.dtype}"
                )
            _close(param.detach(), ref_param.detach(), f"{where}: value of {name}", tol)
