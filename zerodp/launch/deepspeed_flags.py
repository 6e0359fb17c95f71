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
  `--nnodes N --node-rank R`; several hosts without `--no_ssh` need processes started
  on other machines, which zerodp leaves to torchrun on each host: the error prints
  the command for each;
- `--enable_each_rank_log DIR`: torchrun's `--log-dir DIR --redirects 3`;
- every process gets `--local_rank=<its local rank>` in front of its script arguments,
  as from DeepSpeed's launcher, unless `--no_local_rank`.

Flags that only tune DeepSpeed's launcher (core binding, logging level, pid file,
ssh settings on one host) change nothing here and are listed in one warning.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


class LaunchError(ValueError):
    """DeepSpeed launcher flags `zerodp run` cannot serve; the message says what to run."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add DeepSpeed's launcher-only flags to `parser` (each dest is the flag's name)."""
    for names, keywords in _FLAGS:
        parser.add_argument(*names, **keywords)


def flag_dests() -> list[str]:
    return [keywords.get("dest", names[-1].lstrip("-")) for names, keywords in _FLAGS]


@dataclass(frozen=True)
class DeepSpeedLaunch:
    """What DeepSpeed's flags ask of torchrun."""

    nproc: str | None  # None: zerodp's own -n decides
    torchrun_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pass_local_rank: bool = True
    no_effect: tuple[str, ...] = ()


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
    pool = _active_pool(parsed)
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
    pool: dict[str, list[int]],
    log_args: tuple[str, ...],
    no_effect: tuple[str, ...],
    written: set[str],
) -> DeepSpeedLaunch:
    hosts = list(pool)
    num_nodes = parsed.num_nodes if parsed.num_nodes > 0 else len(hosts)
    master = parsed.master_addr if parsed.master_addr != "127.0.0.1" else hosts[0]
    if master == "localhost" and num_nodes > 1:
        master = "<first host's address>"
    port = parsed.master_port or DEFAULT_MASTER_PORT
    per_node = len(next(iter(pool.values())))
    if parsed.no_ssh and written & {"--node_rank", "--node-rank"} and parsed.launcher == "pdsh":
        # --node_rank, and --master_addr / --master_port when written, reach torchrun as given.
        rendezvous = ["--nnodes", str(num_nodes)]
        if not written & {"--master_addr", "--master-addr"}:
            rendezvous += ["--master-addr", master]
        if not written & {"--master_port", "--master-port"}:
            rendezvous += ["--master-port", str(port)]
        return DeepSpeedLaunch(
            nproc=str(per_node),
            torchrun_args=(*rendezvous, *log_args),
            env={"PYTHONUNBUFFERED": "1"},
            pass_local_rank=not parsed.no_local_rank,
            no_effect=no_effect,
        )
    names = hosts if len(hosts) == num_nodes else [f"<host {i}>" for i in range(num_nodes)]
    lines = "\n".join(
        f"  on {name}: zerodp run --nnodes {num_nodes} --node-rank {rank} --master-addr "
        f"{master} --master-port {port} -n {per_node} script.py [args]"
        for rank, name in enumerate(names)
    )
    how = (
        f"--launcher {parsed.launcher}"
        if parsed.launcher != "pdsh"
        else "DeepSpeed's launcher reaches the other hosts over ssh"
    )
    raise LaunchError(
        f"{num_nodes} nodes: zerodp run starts processes on this machine only ({how}); start "
        "it on each host (or pass --no_ssh --node_rank R there, as with DeepSpeed), e.g.\n" + lines
    )


def _active_pool(parsed: argparse.Namespace) -> dict[str, list[int]]:
    """Host -> slots after the hostfile, --include/--exclude, --num_nodes and --num_gpus."""
    if parsed.hostfile:
        pool = _read_hostfile(Path(parsed.hostfile))
    else:
        pool = {"localhost": list(range(_local_slots(parsed)))}
    if parsed.include:
        pool = _include(pool, parsed.include)
    if parsed.exclude:
        pool = _exclude(pool, parsed.exclude)
    if parsed.num_nodes > 0 and parsed.hostfile:
        pool = dict(list(pool.items())[: parsed.num_nodes])
    if parsed.num_gpus > 0:
        short = [h for h, slots in pool.items() if len(slots) < parsed.num_gpus and parsed.hostfile]
        if short:
            raise LaunchError(
                f"--num_gpus {parsed.num_gpus}: host {short[0]} has only "
                f"{len(pool[short[0]])} slots in the hostfile"
            )
        pool = {host: list(range(parsed.num_gpus)) for host in pool}
    empty = [host for host, slots in pool.items() if not slots]
    if empty or not pool:
        raise LaunchError("no processes left to start after --include/--exclude")
    return pool


def _local_slots(parsed: argparse.Namespace) -> int:
    """This machine's accelerators; on a CPU-only machine, what the flags name."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        count = int(accelerator.device_count())
        if parsed.num_gpus > count:
            raise LaunchError(f"--num_gpus {parsed.num_gpus}: this machine has {count}")
        return parsed.num_gpus if parsed.num_gpus > 0 else count
    if parsed.num_gpus > 0:
        return parsed.num_gpus
    if parsed.exclude:
        raise LaunchError(
            "--exclude on a machine without accelerators: there are no device slots to "
            "exclude; give the number of processes with --num_gpus N"
        )
    if parsed.include:
        return 1 + max(slot for spec in _parse_specs(parsed.include).values() for slot in spec)
    return 1


def _read_hostfile(path: Path) -> dict[str, list[int]]:
    if not path.is_file():
        raise LaunchError(f"--hostfile {path}: no such file")
    pool: dict[str, list[int]] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise LaunchError(
                f"--hostfile {path}, line {number}: expected 'hostname slots=N', got {raw!r}"
            )
        if parts[0] in pool:
            raise LaunchError(f"--hostfile {path}: host {parts[0]} is listed twice")
        pool[parts[0]] = list(range(int(parts[1][6:])))
    if not pool:
        raise LaunchError(f"--hostfile {path}: no hosts in it")
    return pool


def _parse_specs(text: str) -> dict[str, list[int]]:
    """DeepSpeed's `host[:slot,slot][@host...]` -> host -> slots ([] for all of them)."""
    specs: dict[str, list[int]] = {}
    for node in text.split("@"):
        host, _, slots = node.partition(":")
        if not host:
            raise LaunchError(f"--include/--exclude {text!r}: a host name is missing")
        try:
            specs[host] = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise LaunchError(
                f"--include/--exclude {text!r}: slots are numbers, as in localhost:0,2"
            ) from None
    return specs


def _local_name(host: str, pool: dict[str, list[int]]) -> str:
    """`host` as the pool names it (this machine answers to localhost and its own names)."""
    if host in pool:
        return host
    if host in _this_machine() and len(pool) == 1:
        return next(iter(pool))
    raise LaunchError(f"--include/--exclude: host {host!r} is not among {sorted(pool)}")


def _this_machine() -> set[str]:
    names = {"localhost", "127.0.0.1", socket.gethostname()}
    names.add(socket.gethostname().split(".")[0])
    return names | ({os.environ["HOSTNAME"]} if "HOSTNAME" in os.environ else set())


def _include(pool: dict[str, list[int]], text: str) -> dict[str, list[int]]:
    chosen: dict[str, list[int]] = {}
    for host, slots in _parse_specs(text).items():
        name = _local_name(host, pool)
        missing = sorted(set(slots) - set(pool[name]))
        if missing:
            raise LaunchError(f"--include: {host} has no slot {missing[0]} (slots {pool[name]})")
        chosen[name] = slots or pool[name]
    return chosen


def _exclude(pool: dict[str, list[int]], text: str) -> dict[str, list[int]]:
    kept = {host: list(slots) for host, slots in pool.items()}
    for host, slots in _parse_specs(text).items():
        name = _local_name(host, pool)
        if not slots:
            del kept[name]
            continue
        missing = sorted(set(slots) - set(pool[name]))
        if missing:
            raise LaunchError(f"--exclude: {host} has no slot {missing[0]} (slots {pool[name]})")
        kept[name] = [s for s in kept[name] if s not in slots]
    return kept
