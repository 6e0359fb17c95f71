"""`DistributedTest` and the helpers DeepSpeed's test files import from `unit.common`.

Written for zerodp (not copied): `DistributedTest` is the marker class the plugin looks
for; `preferred_dtype` and `allclose_on_all_ranks` do what DeepSpeed's helpers of the same
names do (the half dtype the accelerator supports, bf16 first; a comparison with torch's
default tolerances that fails on every rank if it fails on one).
"""

from __future__ import annotations

from typing import Any

import torch

import zerodp.comm as dist
from zerodp.accelerator import get_accelerator


class DistributedTest:
    """Each test method of a subclass runs on `world_size` ranks (see the plugin)."""

    world_size: int = 2


def preferred_dtype() -> torch.dtype:
    accelerator = get_accelerator()
    if accelerator.is_bf16_supported():
        return torch.bfloat16
    if accelerator.is_fp16_supported():
        return torch.float16
    return torch.float32


def allclose_on_all_ranks(
    actual: torch.Tensor, expected: torch.Tensor, assert_message: str | None = None, **kwargs: Any
) -> None:
    problem = ""
    try:
        torch.testing.assert_close(actual, expected, **kwargs)
    except AssertionError as error:
        problem = str(error)
    failed = torch.tensor([1.0 if problem else 0.0])
    dist.all_reduce(failed)
    if failed.item():
        message = assert_message or "Tensors are not close on all ranks."
        raise AssertionError(f"{message} {problem}")
