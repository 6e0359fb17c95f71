"""Run a training script as DeepSpeed's launcher does: `--local_rank=N` before its arguments.

`zerodp run` with DeepSpeed's launcher flags starts each process as
`python -m zerodp.launch.local_rank --as script|module|exec TARGET ARGS...`, which
puts `--local_rank=$LOCAL_RANK` in front of ARGS (scripts written for DeepSpeed
parse it), sets DeepSpeed's `LOCAL_SIZE`, `CROSS_RANK` and `CROSS_SIZE` (the node's
process count, the node's index, the node count) from torchrun's variables (srun's or
mpirun's, read as `zerodp.initialize` reads them), and then runs TARGET as `python
script.py`, `python -m module` or the executable itself would.

Under srun, which gives no node layout in the variables torchrun's are written from,
they come from srun's own: `SLURM_NODEID`, and the tasks of each node of the step
(`SLURM_STEP_TASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE`, as `2(x3),1`: nodes may hold
different counts). Otherwise every rank would report a node of one process, node 0 of
WORLD_SIZE nodes.
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from collections.abc import Mapping, MutableMapping, Sequence

from zerodp.comm.launch_env import read_launch_env
from zerodp.errors import ConfigError

MODES = ("script", "module", "exec")


def deepspeed_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """DeepSpeed's launcher variables, from torchrun's (written from srun's or mpirun's
    first, when they started the process: `zerodp run --launcher slurm|openmpi`)."""
    env = os.environ if environ is None else environ
    layout = None
    if "RANK" not in env and "WORLD_SIZE" not in env:
        launch = read_launch_env(env)
        env.update(launch.torchrun_variables)
        if launch.launcher.startswith("srun"):
            layout = slurm_layout(env)
    if layout is None:
        local_size = env.get("LOCAL_WORLD_SIZE", "1")
        world = int(env.get("WORLD_SIZE", "1"))
        layout = {
            "LOCAL_SIZE": local_size,
            "CROSS_RANK": env.get("GROUP_RANK", "0"),
            "CROSS_SIZE": str(max(1, world // max(1, int(local_size)))),
        }
    for name, value in layout.items():
        env.setdefault(name, value)


_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def tasks_per_node(text: str) -> list[int]:
    """SLURM's tasks per node, one count per node: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        found = _TASKS.fullmatch(part.strip())
        if found is None:
            raise ConfigError(f"SLURM tasks per node {text!r}: expected counts as in 2(x3),1")
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts


def slurm_layout(env: Mapping[str, str]) -> dict[str, str] | None:
    """An srun task's node layout in DeepSpeed's names: its node's task count, the node's
    index, the node count (the task list has one count per node of the step); None when
    srun gave no `SLURM_NODEID` or tasks per node."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    text = text or env.get("SLURM_TASKS_PER_NODE", "").strip()
    node = env.get("SLURM_NODEID", "").strip()
    if not text or not node.isdigit():
        return None
    counts = tasks_per_node(text)
    if int(node) >= len(counts):
        raise ConfigError(
            f"SLURM_NODEID={node} is not below the {len(counts)} nodes of the tasks per "
            f"node {text!r}"
        )
    return {
        "LOCAL_SIZE": str(counts[int(node)]),
        "CROSS_RANK": node,
        "CROSS_SIZE": str(len(counts)),
    }


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
