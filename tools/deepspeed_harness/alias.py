"""`import deepspeed` gives zerodp: the module and all of its submodules, by the same path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

import torch

import zerodp


class _Existing(importlib.abc.Loader):
    """Loads `deepspeed.x` as the already imported `zerodp.x`."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class DeepSpeedToZeroDP(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("deepspeed."):
            return None
        module = importlib.import_module("zerodp." + fullname[len("deepspeed.") :])
        return importlib.machinery.ModuleSpec(fullname, _Existing(module))


class _CpuDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP that drops `device_ids` / `output_device` for a CPU module (DDP accepts them for
    GPU modules only; DeepSpeed's GPU tests pass them). The reference side of the tests."""

    def __init__(self, module: torch.nn.Module, device_ids=None, output_device=None, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


def install(cpu_ddp: bool, fp32: bool = False) -> None:
    """Re-point `deepspeed` to zerodp in this process (and, with `cpu_ddp`, DDP as above).

    With `fp32` (a diagnostic run) the CPU accelerator reports no bf16, so tests that pick
    their dtype from it train in fp32 on both sides.
    """
    sys.modules.setdefault("deepspeed", zerodp)
    if not any(isinstance(f, DeepSpeedToZeroDP) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedToZeroDP())
    if cpu_ddp:
        torch.nn.parallel.DistributedDataParallel = _CpuDDP  # type: ignore[misc]
    if fp32:
        from zerodp.accelerator.devices import CpuAccelerator

        CpuAccelerator.is_bf16_supported = lambda self: False  # type: ignore[method-assign]
