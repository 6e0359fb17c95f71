"""Run one of DeepSpeed's unit-test files against zerodp, with only the name re-pointed.

    python tools/run_deepspeed_tests.py PATH/test_zero_user_backward.py [--fp32] [pytest options]

The file is used as it is, from where it lies (DeepSpeed's code stays out of this
repository): `deepspeed` and `deepspeed.x` resolve to `zerodp` and `zerodp.x`, and
`unit.common` / `unit.simple_model` (DeepSpeed's `DistributedTest` harness and the helpers
its tests import) come from tools/deepspeed_harness. Each `DistributedTest` method runs on
its `world_size` ranks (gloo). On a machine without GPUs, the tests' DDP references are
built without `device_ids` (DDP takes them for GPU modules only); the run says so.
`--fp32` is a diagnostic: the CPU accelerator then reports no bf16, so the tests that pick
their dtype from it (DeepSpeed's CPU accelerator reports bf16) train in fp32 on both sides,
which tells precision differences from others. Prints pytest's summary: which tests pass,
and each failure's reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
HARNESS = TOOLS / "deepspeed_harness"  # holds `unit`, imported by that name


def main(argv: list[str]) -> int:
    if not argv or not argv[0].endswith(".py") or not Path(argv[0]).is_file():
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    source, pytest_args = Path(argv[0]), [a for a in argv[1:] if a != "--fp32"]
    import torch

    cpu_ddp = not torch.cuda.is_available()
    if cpu_ddp:
        print("no GPU: the tests' DDP references are built without device_ids", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / source.name
        shutil.copyfile(source, target)  # a scratch copy, so pytest's rootdir is the scratch
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TOOLS), str(HARNESS), folder, str(ROOT)]),
            "DS_HARNESS_CPU_DDP": "1" if cpu_ddp else "0",
            "DS_HARNESS_FP32": "1" if "--fp32" in argv[1:] else "0",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        command = [
            *(sys.executable, "-m", "pytest", str(target), "-p", "deepspeed_harness.plugin"),
            *("-p", "no:cacheprovider", "-q", "-rA", "--rootdir", folder, *pytest_args),
        ]
        return subprocess.run(command, env=env, cwd=folder, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
