"""Comparing a zerodp-trained model with the data-parallel reference, parameter by parameter."""

from __future__ import annotations

import torch
from torch import nn

from zerodp import utils
from zerodp.testing.reference import ReferenceDP

FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: dict[str, float]) -> None:
    def describe(message: str) -> str:
        return f"{what}: {message}"

    torch.testing.assert_close(
        actual.cpu(), expected.cpu(), rtol=tol["rtol"], atol=tol["atol"], msg=describe
    )


def assert_grads_match(
    model: nn.Module, reference: ReferenceDP, where: str, **tolerance: float
) -> None:
    """Every full gradient of `model` (a collective) equals the reference's."""
    tol = {**FP32_TOLERANCE, **tolerance}
    for (name, param), ref_param in zip(
        model.named_parameters(), reference.model.parameters(), strict=True
    ):
        if not ref_param.requires_grad:
            continue
        full = utils.safe_get_full_grad(param)
        expected = reference.grad(ref_param)
        if full is None:
            full = torch.zeros_like(expected)
        _close(full, expected, f"{where}: grad of {name}", tol)


def assert_params_match(
    model: nn.Module, reference: ReferenceDP, where: str, **tolerance: float
) -> None:
    """Every full parameter of `model` (a collective) equals the reference's."""
    tol = {**FP32_TOLERANCE, **tolerance}
    for (name, param), ref_param in zip(
        model.named_parameters(), reference.model.parameters(), strict=True
    ):
        full = utils.safe_get_full_fp32_param(param)
        _close(full, ref_param.detach().float(), f"{where}: value of {name}", tol)
