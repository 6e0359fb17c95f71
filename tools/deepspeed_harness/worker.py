"""What each rank runs for one DeepSpeed test method (called through zerodp's WorkerPool)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest
from deepspeed_harness import alias


def run_test(folder: str, module_name: str, class_name: str, method: str, kwargs: dict) -> Any:
    """Run `module_name.class_name().method(**kwargs)`; ("skipped", why) if it skips."""
    alias.install(
        cpu_ddp=os.environ.get("DS_HARNESS_CPU_DDP") == "1",
        fp32=os.environ.get("DS_HARNESS_FP32") == "1",
    )
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.import_module(module_name)
    instance = getattr(module, class_name)()
    try:
        getattr(instance, method)(**kwargs)
    except pytest.skip.Exception as skipped:
        return ("skipped", str(skipped.msg))
    return ("passed", "")
