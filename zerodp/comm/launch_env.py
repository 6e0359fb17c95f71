"""Who started this process: torchrun, srun (SLURM) or mpirun, read from their variables.

`ensure_process_group` sets the default process group up from torchrun's variables
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`). Clusters mostly
start jobs otherwise: `srun python train.py` gives each task `SLURM_PROCID`,
`SLURM_NTASKS` (`SLURM_STEP_NUM_TASKS` first: the step's), `SLURM_LOCALID` and the
job's hosts in `SLURM_NODELIST`; Open MPI's `mpirun` gives `OMPI_COMM_WORLD_RANK`,
`_SIZE` and `_LOCAL_RANK`; MVAPICH's `MV2_COMM_WORLD_RANK`, `_SIZE` and `_LOCAL_RANK`;
MPICH and Intel MPI (hydra) give `PMI_RANK`, `PMI_SIZE` and `MPI_LOCALRANKID`. When
torchrun's variables are absent, this module reads those and writes torchrun's from
them, so that everything after it (the process group's `env://` rendezvous, the device
a rank picks from `LOCAL_RANK`, the node layout from `LOCAL_WORLD_SIZE`, a script that
reads `RANK`) sees one launcher.

The master (rank 0's host, where the rendezvous store listens) is `MASTER_ADDR` when
set; under srun, the first host of the step's node list (rank 0 runs there); under
mpirun, which names no host, 127.0.0.1 when every rank runs on this node and otherwise
an error asking for `MASTER_ADDR`. The port is `MASTER_PORT`, else `DEFAULT_MASTER_PORT`.

A partial environment (`RANK` without `WORLD_SIZE`, `SLURM_PROCID` without
`SLURM_NTASKS`, a rank outside the world) is a `ConfigError` naming what is missing: it
never falls back to a world of one, where each process would train alone without a word.
One launcher's partial variables give way to a later launcher whose variables are complete
and give the same rank and world size: srun's pmi2 plugin (`srun --mpi=pmi2`, the default
on many clusters) sets `PMI_RANK` and `PMI_SIZE` but no `MPI_LOCALRANKID`, and srun's own
variables then say the rest. A later launcher that disagrees (the SLURM variables of the
batch script around an `mpiexec`) is no such source: the error stands.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from zerodp.errors import ConfigError

DEFAULT_MASTER_PORT = 29500
"""The rendezvous port when `MASTER_PORT` is not set (torchrun's and DeepSpeed's default)."""

_TORCHRUN = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Launcher:
    """One launcher's variables: the rank's, the world's, the rank's place on its node
    (None: the launcher has none), and the node's rank count (None: not given)."""

    name: str
    rank: str
    size: str
    local_rank: str | None
    local_size: str | None
    step_size: str | None = None  # the job step's own count, read before `size` when set


# In order of precedence: mpirun run inside a SLURM allocation passes the SLURM variables
# of its daemons on to its ranks, so Open MPI's and PMI's are read before SLURM's.
LAUNCHERS: tuple[Launcher, ...] = (
    Launcher(
        "mpirun (Open MPI)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    Launcher(
        "mpirun (MVAPICH)",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    Launcher("mpirun (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Launcher(
        "srun (SLURM)",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        None,
        step_size="SLURM_STEP_NUM_TASKS",  # an srun of fewer tasks than the allocation's
    ),
)

_SLURM_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process stands: started by `launcher`, the world it belongs to, the
    torchrun variables to set (none for torchrun's own), and whether the process group
    needs a rendezvous (torchrun's always has one; a world of one from elsewhere not)."""

    launcher: str
    world_size: int
    torchrun_variables: dict[str, str]
    rendezvous: bool


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launcher of this process and torchrun's variables from its own.

    Raises `ConfigError` naming the missing or bad variables for a partial environment.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN):
        missing = [name for name in _TORCHRUN if not env.get(name, "").strip()]
        if missing:
            raise ConfigError(
                f"torchrun's environment is partial: {' and '.join(missing)} not set while "
                f"{' and '.join(n for n in _TORCHRUN if n not in missing)} is; start the "
                "script with torchrun (or zerodp run), or set RANK and WORLD_SIZE together "
                "(with MASTER_ADDR and MASTER_PORT)"
            )
        world = _count(env, "WORLD_SIZE", minimum=1)
        _rank_below(_count(env, "RANK"), world, "RANK", "WORLD_SIZE")
        return LaunchEnv("torchrun", world, {}, rendezvous=True)
    present = [_stepped(one, env) for one in LAUNCHERS if one.rank in env or one.size in env]
    if not present:
        return LaunchEnv("none (a single process)", 1, {}, rendezvous=False)
    return _from_launcher(_complete_launcher(present, env), env)


def adopt_launch_env() -> LaunchEnv:
    """Read this process's launcher and write torchrun's variables from its own into the
    environment (nothing for torchrun's, or a single process); idempotent."""
    launch = read_launch_env()
    os.environ.update(launch.torchrun_variables)
    return launch


def _stepped(launcher: Launcher, env: Mapping[str, str]) -> Launcher:
    """`launcher` with the job step's own count as its size, when the step gives one."""
    if launcher.step_size is not None and env.get(launcher.step_size, "").strip():
        return dataclasses.replace(launcher, size=launcher.step_size)
    return launcher


def _missing(launcher: Launcher, env: Mapping[str, str]) -> list[str]:
    wanted = [launcher.rank, launcher.size]
    if launcher.local_rank is not None:
        wanted.append(launcher.local_rank)
    return [name for name in wanted if not env.get(name, "").strip()]


def _complete_launcher(present: list[Launcher], env: Mapping[str, str]) -> Launcher:
    """The first of `present` (in precedence order) whose variables are complete, when
    every partial one before it agrees with it on the rank and world size it gives (srun's
    pmi2 plugin: PMI_RANK and PMI_SIZE, no MPI_LOCALRANKID); else a `ConfigError` naming
    what the first one lacks."""
    other = ""
    for index, launcher in enumerate(present):
        if _missing(launcher, env):
            continue
        if all(_agrees(partial, launcher, env) for partial in present[:index]):
            return launcher
        other = (
            f"; the variables of {launcher.name} are complete but give another rank or world "
            f"size ({launcher.rank}={env[launcher.rank]}, {launcher.size}={env[launcher.size]})"
        )
        break
    first = present[0]
    missing = _missing(first, env)
    given = [n for n in (first.rank, first.size, first.local_rank) if n and n not in missing]
    set_beside = f" (while {', '.join(given)} is)" if given else ""
    raise ConfigError(
        f"the environment of {first.name} is partial: {', '.join(missing)} not set"
        f"{set_beside}{other}; start every process with {first.name.split()[0]}, or set "
        "torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
    )


def _agrees(partial: Launcher, complete: Launcher, env: Mapping[str, str]) -> bool:
    """Whether the rank and world size `partial` gives are `complete`'s (the same launch)."""
    pairs = ((partial.rank, complete.rank), (partial.size, complete.size))
    return all(
        env[mine].strip() == env[theirs].strip()
        for mine, theirs in pairs
        if env.get(mine, "").strip()
    )


def _from_launcher(launcher: Launcher, env: Mapping[str, str]) -> LaunchEnv:
    world = _count(env, launcher.size, minimum=1)
    rank = _rank_below(_count(env, launcher.rank), world, launcher.rank, launcher.size)
    local_rank = _count(env, launcher.local_rank) if launcher.local_rank else 0
    variables = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)}
    if world == 1:
        return LaunchEnv(launcher.name, 1, variables, rendezvous=False)
    local_size = None
    if launcher.local_size is not None and env.get(launcher.local_size, "").strip():
        local_size = _count(env, launcher.local_size, minimum=1)
        variables["LOCAL_WORLD_SIZE"] = str(local_size)
    variables["MASTER_ADDR"] = _master_addr(launcher, env, world, local_size)
    variables["MASTER_PORT"] = _master_port(env)
    return LaunchEnv(launcher.name, world, variables, rendezvous=True)


def _master_addr(
    launcher: Launcher, env: Mapping[str, str], world: int, local_size: int | None
) -> str:
    given = env.get("MASTER_ADDR", "").strip()
    if given:
        return given
    if launcher.rank == "SLURM_PROCID":
        for name in _SLURM_NODE_LISTS:
            text = env.get(name, "").strip()
            if text:
                return first_host(text)
        raise ConfigError(
            f"srun's environment names no hosts ({', '.join(_SLURM_NODE_LISTS)} not set): "
            "set MASTER_ADDR to the host of rank 0"
        )
    if local_size == world:
        return "127.0.0.1"  # every rank on this node
    raise ConfigError(
        f"{launcher.name} does not say which host rank 0 runs on: set MASTER_ADDR to it for "
        "every rank (e.g. mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...)"
    )


def _master_port(env: Mapping[str, str]) -> str:
    text = env.get("MASTER_PORT", "").strip()
    if not text:
        return str(DEFAULT_MASTER_PORT)
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"MASTER_PORT={text!r}: expected a port number (1-65535)")
    return text


def _count(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    text = env.get(name, "").strip()
    if not text.isdigit() or int(text) < minimum:
        raise ConfigError(f"{name}={text!r}: expected an integer >= {minimum}")
    return int(text)


def _rank_below(rank: int, world: int, rank_name: str, size_name: str) -> int:
    if rank >= world:
        raise ConfigError(
            f"{rank_name}={rank} is not below {size_name}={world}: the ranks of a world of "
            f"{world} are 0..{world - 1}"
        )
    return rank


_BRACKETS = re.compile(r"\[([^\]]*)\]")


def first_host(node_list: str) -> str:
    """The first host of a SLURM node list: `node[01-03,07],gpu5` -> `node01`.

    Ranges keep their zero padding, and a name may hold several bracketed parts
    (`rack[1-2]-n[3-4]` -> `rack1-n3`), as `scontrol show hostnames` expands them.
    """
    depth = 0
    end = len(node_list)
    for index, char in enumerate(node_list):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    first = node_list[:end].strip()

    def first_of(match: re.Match[str]) -> str:
        return match.group(1).split(",")[0].split("-")[0].strip()

    host = _BRACKETS.sub(first_of, first)
    if not host or "[" in host or "]" in host:
        raise ConfigError(f"SLURM node list {node_list!r}: cannot read its first host")
    return host
