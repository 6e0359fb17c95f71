"""The hosts and slots a launch uses: DeepSpeed's hostfile, `--include` / `--exclude`,
`--num_nodes` and `--num_gpus`, resolved to an ordered map of host -> slots.

A hostfile has one `hostname slots=N` line per host (`#` starts a comment); the
first host is node 0. `--include` / `--exclude` take DeepSpeed's `host[:slot,slot]`
specs joined by `@`. Without a hostfile the pool is this machine (`localhost`), its
accelerators, or on a machine without any the slots the flags name.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path


class LaunchError(ValueError):
    """Launcher flags `zerodp run` cannot serve; the message says what to run instead."""


Pool = dict[str, list[int]]
"""Host -> the slots (device indices) used on it, in the hostfile's order."""


def active_pool(parsed: argparse.Namespace) -> Pool:
    """Host -> slots after the hostfile, --include/--exclude, --num_nodes and --num_gpus."""
    if parsed.hostfile:
        pool = read_hostfile(Path(parsed.hostfile))
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


def read_hostfile(path: Path) -> dict[str, list[int]]:
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
