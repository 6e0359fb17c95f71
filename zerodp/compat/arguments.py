"""DeepSpeed's command-line flags and `initialize(args=...)`, as a DeepSpeed script uses them.

`add_config_arguments(parser)` adds the flags DeepSpeed's does (`--deepspeed`,
`--deepspeed_config`, and the older `--deepscale`, `--deepscale_config`).
`initialize` then reads the config path from `args` as DeepSpeed does, and
refuses a config given twice (`args.deepspeed_config` and `config=`, or
`config=` and `config_params=` with different values), naming both places.
After `initialize`, `args.local_rank` holds the launcher's `LOCAL_RANK`, as
DeepSpeed sets it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from torch import nn

from zerodp.errors import UsageError

__all__ = ["add_config_arguments", "config_from_arguments", "deepspeed_argument_order"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's config flags to `parser` (one argument group) and return it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-style configuration (zerodp)")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="a flag for the script's own use (DeepSpeed's); zerodp reads nothing from it",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="path of the JSON config file"
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="older name of --deepspeed"
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="older name of --deepspeed_config"
    )
    return parser


def config_from_arguments(args: Any, config: Any, config_params: Any) -> Any:
    """The one config `initialize` was given: `config`, `config_params` or `args`' path.

    `args.deepscale_config` is read as `args.deepspeed_config` (DeepSpeed's older
    flag), and `args.zerodp_config` as well. Two different sources raise
    `UsageError` naming both.
    """
    if config is not None and config_params is not None and config is not config_params:
        raise UsageError(
            "initialize() was given a config twice: config= and config_params= (DeepSpeed's "
            "older name for it); pass one"
        )
    given = config if config is not None else config_params
    keyword = "config=" if config is not None else "config_params="
    from_args = _config_in_args(args)
    if from_args is None:
        return given
    flag, path = from_args
    if given is not None:
        raise UsageError(
            f"initialize() was given a config twice: {keyword} and {flag} ({path!r}, from "
            "the command line); drop one of them"
        )
    return path


def _config_in_args(args: Any) -> tuple[str, Any] | None:
    """(where, path) of the config in `args`, if any."""
    if args is None:
        return None
    found = [
        (f"args.{name}", getattr(args, name))
        for name in ("deepspeed_config", "deepscale_config", "zerodp_config")
        if getattr(args, name, None) is not None
    ]
    if len(found) > 1:
        places = " and ".join(f"{where} ({value!r})" for where, value in found)
        raise UsageError(f"initialize(args=...) holds a config twice: {places}; keep one")
    return found[0] if found else None


def sync_local_rank(args: Any) -> None:
    """DeepSpeed's check and update of `args.local_rank` against the launcher's LOCAL_RANK."""
    if args is None or not hasattr(args, "local_rank"):
        return
    launcher = int(os.environ.get("LOCAL_RANK", "0"))
    given = args.local_rank
    if isinstance(given, int) and given >= 0 and given != launcher:
        raise UsageError(
            f"args.local_rank is {given} but the launcher set LOCAL_RANK={launcher}; "
            "leave --local_rank to the launcher"
        )
    args.local_rank = launcher


def refuse_deepspeed_arguments(mpu: Any, mesh_param: Any, dist_init_required: Any) -> None:
    """DeepSpeed's `initialize` keywords for features zerodp does not have."""
    if mpu is not None:
        raise UsageError(
            "initialize(mpu=...): a Megatron mpu is not read by zerodp; drop mpu and set "
            '"tensor_parallel": {"autotp_size": T} in the config for tensor parallelism '
            "(docs/tensor-parallel.md), or use zero_optimization.stage 3"
        )
    if mesh_param is not None:
        raise UsageError(
            "initialize(mesh_param=...): zerodp builds its mesh from the config; drop it and set "
            '"sequence_parallel_size": S (docs/sequence-parallel.md)'
        )
    if dist_init_required is False:
        from zerodp.comm import is_initialized

        if not is_initialized():
            raise UsageError(
                "initialize(dist_init_required=False) but the process group is not set up; "
                "set it up first (zerodp.init_distributed()) or leave dist_init_required out"
            )


def deepspeed_argument_order(model: Any, config: Any) -> bool:
    """Whether `initialize`'s first two positionals are DeepSpeed's `(args, model)`.

    zerodp's first positional is the model; DeepSpeed's is `args`. An argparse
    namespace (or None) first and a module second can only mean DeepSpeed's order.
    """
    return (model is None or isinstance(model, argparse.Namespace)) and isinstance(
        config, nn.Module
    )
