"""Run a training script as DeepSpeed's launcher does: `--local_rank=N` before its arguments.

`zerodp run` with DeepSpeed's launcher flags starts each process as
`python -m zerodp.launch.local_rank --as script|module|exec TARGET ARGS...`, which
puts `--local_rank=$LOCAL_RANK` in front of ARGS (scripts written for DeepSpeed
parse it), sets DeepSpeed's `LOCAL_SIZE`, `CROSS_RANK` and `CROSS_SIZE` from
torchrun's variables (srun's or mpirun's, read as `zerodp.initialize` reads them), and
then runs TARGET as `python script.py`, `python -m
module` or the executable itself would.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from zerodp.comm.launch_env import adopt_launch_env

MODES = ("script", "module", "exec")


def deepspeed_environment() -> None:
    """DeepSpeed's launcher variables, from torchrun's (written from srun's or mpirun's
    first, when they started the process: `zerodp run --launcher slurm|openmpi`)."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        adopt_launch_env()
    local_size = os.environ.get("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_SIZE", local_size)
    os.environ.setdefault("CROSS_RANK", os.environ.get("GROUP_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("CROSS_SIZE", str(max(1, world // max(1, int(local_size)))))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "--as" or args[1] not in MODES:
        raise SystemExit(f"usage: python -m {__name__} --as {{{','.join(MODES)}}} TARGET [ARGS]")
    mode, target, rest = args[1], args[2], args[3:]
    deepspeed_environment()
    script_args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *rest]
    if mode == "exec":
        os.execvp(target, [target, *script_args])
    sys.argv = [target, *script_args]
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
