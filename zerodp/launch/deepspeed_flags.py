"""DeepSpeed's launcher flags for `zerodp run`, turned into torchrun's.

`deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json` becomes
`zerodp run --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json`. The
flags DeepSpeed's launcher shares with torchrun (`--master_addr`, `--master_port`,
`--node_rank`, `--module`, `--no_python`) are torchrun's already; this module
adds the others and translates them:

- `--num_gpus N` (`--num_accelerators`): N processes on this machine;
- `--include` / `--exclude` (`host:slot,slot@host...`) and `--hostfile` (`host slots=N`
  lines): on one host, the chosen slots become the process count and
  `CUDA_VISIBLE_DEVICES`, as DeepSpeed sets it;
- `--num_nodes N` with `--no_ssh --node_rank R` (DeepSpeed's launch on each node): torchrun's
  `--nnodes N --node-rank R`;
- several hosts (a hostfile, `--include` / `--exclude` / `--num_nodes` choosing among them,
  `--force_multi`): `SeveralHosts`, which `zerodp.launch.multinode_runner` starts: over
  pdsh or ssh (`--launcher pdsh`, the default; `--ssh_port`, `--launcher_args`), or as
  one `srun` / `mpirun` command (`--launcher slurm`, `--launcher openmpi`);
- `--enable_each_rank_log DIR`: torchrun's `--log-dir DIR --redirects 3`;
- every process gets `--local_rank=<its local rank>` in front of its script arguments,
  as from DeepSpeed's launcher, unless `--no_local_rank`.

Flags that only tune DeepSpeed's launcher (core binding, logging level, pid file,
ssh settings on one host) change nothing here and are listed in one warning.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from typing import Any

from zerodp.launch.hostfile import LaunchError, Pool, active_pool

DEFAULT_MASTER_PORT = 29500  # DeepSpeed's launcher default
LOCAL_RANK_MODULE = "zerodp.launch.local_rank"

# (flag names, argparse keywords): the flags DeepSpeed's launcher has and torchrun has not.
_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("-H", "--hostfile"), {"default": None}),
    (("-i", "--include"), {"default": ""}),
    (("-e", "--exclude"), {"default": ""}),
    (("--num_nodes",), {"type": int, "default": -1}),
    (("--num_gpus", "--num_accelerators"), {"type": int, "default": -1, "dest": "num_gpus"}),
    (("--no_local_rank",), {"action": "store_true"}),
    (("--no_ssh",), {"action": "store_true"}),
    (("--no_ssh_check",), {"action": "store_true"}),
    (("--force_multi",), {"action": "store_true"}),
    (("--launcher",), {"default": "pdsh"}),
    (("--launcher_args",), {"default": ""}),
    (("--save_pid",), {"action": "store_true"}),
    (("--enable_each_rank_log",), {"default": "None"}),
    (("--autotuning",), {"default": ""}),
    (("--bind_cores_to_rank",), {"action": "store_true"}),
    (("--bind_core_list",), {"default": None}),
    (("--ssh_port",), {"type": int, "default": None}),
    (("--venv_script",), {"default": None}),
    (("--log_level",), {"default": "info"}),
    (("-q", "--quiet"), {"action": "store_true"}),
    (("--elastic_training",), {"action": "store_true"}),
    (("--min_elastic_nodes",), {"type": int, "default": -1}),
    (("--max_elastic_nodes",), {"type": int, "default": -1}),
)
# Flags that only tune DeepSpeed's own launcher: accepted, with no effect here.
_NO_EFFECT = {
    "no_ssh_check": "--no_ssh_check",
    "save_pid": "--save_pid",
    "bind_cores_to_rank": "--bind_cores_to_rank",
    "bind_core_list": "--bind_core_list",
    "ssh_port": "--ssh_port",
    "venv_script": "--venv_script",
    "log_level": "--log_level",
    "quiet": "--quiet",
}

_SEVERAL_NODES = {
    "launcher": "--launcher",
    "launcher_args": "--launcher_args",
    "no_ssh": "--no_ssh",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add DeepSpeed's launcher-only flags to `parser` (each dest is the flag's name)."""
    for names, keywords in _FLAGS:
        parser.add_argument(*names, **keywords)


def flag_dests() -> list[str]:
    return [keywords.get("dest", names[-1].lstrip("-")) for names, keywords in _FLAGS]


LAUNCHERS = ("pdsh", "slurm", "openmpi")
"""The `--launcher` values for several hosts that zerodp serves (pdsh: pdsh, or ssh)."""


@dataclass(frozen=True)
class SeveralHosts:
    """A launch on the hosts of `pool` that zerodp starts itself (`launch.multinode_runner`).

    `master_addr` None: the first host's address, asked of it when the launch starts.
    """

    pool: Pool
    launcher: str
    launcher_args: tuple[str, ...]
    master_addr: str | None
    master_port: int
    ssh_port: int | None


@dataclass(frozen=True)
class DeepSpeedLaunch:
    """What DeepSpeed's flags ask of torchrun (on this machine, or on each of `hosts`)."""

    nproc: str | None  # None: zerodp's own -n decides (or, with hosts, each host's slots)
    torchrun_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pass_local_rank: bool = True
    no_effect: tuple[str, ...] = ()
    hosts: SeveralHosts | None = None


def deepspeed_launch(
    parsed: argparse.Namespace, defaults: argparse.Namespace, written: set[str]
) -> DeepSpeedLaunch | None:
    """The torchrun side of DeepSpeed's flags in `parsed`; None when none was given.

    `written` holds the option names on the command line (`--node_rank` may be written
    with torchrun's default value 0 and still count as given)."""
    given = [d for d in flag_dests() if getattr(parsed, d) != getattr(defaults, d)]
    if not given:
        return None
    if parsed.autotuning:
        raise LaunchError("--autotuning: zerodp has no autotuner; drop the flag")
    if parsed.elastic_training:
        raise LaunchError(
            "--elastic_training: use torchrun's elastic launch instead: zerodp run "
            "--nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint HOST:PORT ..."
        )
    if (parsed.num_nodes >= 0 or parsed.num_gpus >= 0) and (parsed.include or parsed.exclude):
        raise LaunchError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude (as in "
            "DeepSpeed); choose the processes with one of them"
        )
    if parsed.include and parsed.exclude:
        raise LaunchError("--include and --exclude cannot be combined (as in DeepSpeed)")
    pool = active_pool(parsed)
    no_effect = tuple(_NO_EFFECT[d] for d in given if d in _NO_EFFECT)
    log_args: tuple[str, ...] = ()
    if parsed.enable_each_rank_log != "None":
        log_args = ("--log-dir", parsed.enable_each_rank_log, "--redirects", "3")
    if len(pool) > 1 or parsed.force_multi or parsed.num_nodes > 1:
        return _multi_node(parsed, pool, log_args, no_effect, written)
    (slots,) = pool.values()
    # Flags for DeepSpeed's launch on several nodes: on one, DeepSpeed ignores them too.
    no_effect += tuple(flag for dest, flag in _SEVERAL_NODES.items() if dest in given)
    env = {"PYTHONUNBUFFERED": "1"}
    if parsed.include or parsed.exclude or parsed.hostfile:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    return DeepSpeedLaunch(
        nproc=str(len(slots)),
        torchrun_args=log_args,
        env=env,
        pass_local_rank=not parsed.no_local_rank,
        no_effect=no_effect,
    )


def _multi_node(
    parsed: argparse.Namespace,
    pool: Pool,
    log_args: tuple[str, ...],
    no_effect: tuple[str, ...],
    written: set[str],
) -> DeepSpeedLaunch:
    hosts = list(pool)
    num_nodes = parsed.num_nodes if parsed.num_nodes > 0 else len(hosts)
    given_master = bool(written & {"--master_addr", "--master-addr"})
    port = parsed.master_port or DEFAULT_MASTER_PORT
    if parsed.no_ssh and written & {"--node_rank", "--node-rank"} and parsed.launcher == "pdsh":
        # DeepSpeed's launch on each node: --node_rank, and --master_addr / --master_port
        # when written, reach torchrun as given; the master is the first host otherwise.
        rendezvous = ["--nnodes", str(num_nodes)]
        if not given_master:
            rendezvous += ["--master-addr", hosts[0]]
        if not written & {"--master_port", "--master-port"}:
            rendezvous += ["--master-port", str(port)]
        return DeepSpeedLaunch(
            nproc=str(len(pool[hosts[0]])),
            torchrun_args=(*rendezvous, *log_args),
            env={"PYTHONUNBUFFERED": "1"},
            pass_local_rank=not parsed.no_local_rank,
            no_effect=no_effect,
        )
    if num_nodes > len(hosts) or (parsed.num_nodes > 1 and not parsed.hostfile):
        raise LaunchError(
            f"--num_nodes {num_nodes}: {len(hosts)} host(s) to choose from; list the hosts "
            "in a hostfile (--hostfile, 'host slots=N' lines)"
        )
    if parsed.no_ssh:
        raise LaunchError(
            "--no_ssh starts this node only: give its --node_rank (and --master_addr), as "
            "with DeepSpeed, or drop --no_ssh to start every host from here"
        )
    if parsed.launcher not in LAUNCHERS:
        raise LaunchError(_other_launcher(parsed.launcher))
    hosts_launch = SeveralHosts(
        pool=pool,
        launcher=parsed.launcher,
        launcher_args=tuple(shlex.split(parsed.launcher_args)),
        master_addr=parsed.master_addr if given_master else None,
        master_port=int(port),
        ssh_port=parsed.ssh_port,
    )
    return DeepSpeedLaunch(
        nproc=None,
        torchrun_args=log_args,
        env={"PYTHONUNBUFFERED": "1"},
        pass_local_rank=not parsed.no_local_rank,
        no_effect=tuple(flag for flag in no_effect if flag != "--ssh_port"),
        hosts=hosts_launch,
    )


def _other_launcher(launcher: str) -> str:
    return (
        f"--launcher {launcher}: zerodp run starts several hosts with pdsh (or ssh), srun "
        "(--launcher slurm) or Open MPI's mpirun (--launcher openmpi); with another MPI, run "
        "its launcher yourself, one process per rank (zerodp reads PMI_RANK and PMI_SIZE, "
        "and MASTER_ADDR for rank 0's host), e.g. mpirun -np N -genv MASTER_ADDR=<first "
        "host> python train.py [args]"
    )
