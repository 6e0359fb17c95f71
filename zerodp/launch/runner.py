"""`zerodp run`: turn zerodp's command line into torchrun's and run torchrun in-process.

zerodp deliberately has no launcher of its own: process spawning, rendezvous,
restarts and failure reporting are PyTorch's `torch.distributed.run`. This
module only (1) finds the script path using torchrun's own argument parser,
so every torchrun flag (and its arity) is understood without a copy of the
list, (2) adds `--standalone` when no multi-node flag was given, so a single
machine needs no rendezvous set-up, and (3) turns torchrun's failure exception
back into the script's exit status, which is what shells and CI look at, after
printing torchrun's failure summary (which ranks failed, with what exit code,
and the first failure) to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from zerodp.launch import deepspeed_flags

NPROC_KEYWORDS: tuple[str, ...] = ("auto", "cpu", "gpu", "xpu")
"""Non-numeric process counts torchrun resolves itself (per CPU or per device)."""

# Namespace fields torchrun fills from rendezvous / multi-node flags. Any of
# them differing from its default means the user is setting up the rendezvous
# themselves, so zerodp must not add `--standalone`.
_MULTI_NODE_FIELDS: tuple[str, ...] = (
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "local_addr",
    "standalone",
)

RUN_USAGE = (
    "zerodp run [-n N] [torchrun options | DeepSpeed launcher options] script.py [script args ...]"
)

RUN_DESCRIPTION = (
    "Start N local processes running script.py through PyTorch's torchrun "
    "(torch.distributed.run). With no multi-node flag, torchrun runs --standalone."
)

RUN_EPILOG = (
    "Any option before the script path that zerodp does not know is passed to torchrun "
    "unchanged, e.g. --nnodes, --node-rank, --master-addr, --master-port, --rdzv-backend, "
    "--rdzv-endpoint, --rdzv-id, --max-restarts, --log-dir, --redirects, --tee "
    "(see `python -m torch.distributed.run --help`). DeepSpeed's launcher options are "
    "understood too: --num_gpus, --num_nodes, --include, --exclude, --hostfile, "
    "--no_local_rank, --enable_each_rank_log, ... (docs/deepspeed.md); with them each "
    "process gets --local_rank=N first, as from the deepspeed command. Everything after "
    "the script path goes to the script. The exit status is the script's."
)


class RunUsageError(ValueError):
    """A `zerodp run` command line that cannot be launched; the message names the fix."""


@dataclass(frozen=True)
class RunPlan:
    """What `zerodp run` will hand to torchrun (and set in the workers' environment)."""

    nproc_per_node: str
    script: str
    script_args: tuple[str, ...]
    torchrun_argv: tuple[str, ...]
    standalone_added: bool
    env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


class _RaisingParser(argparse.ArgumentParser):
    """torchrun's parser, but errors raise instead of exiting with torchrun's usage text."""

    def error(self, message: str) -> NoReturn:
        if "training_script" in message:
            message = "missing the script to run, e.g. `zerodp run -n 2 train.py`"
        raise RunUsageError(message)


class _HelpAction(argparse.Action):
    """Print zerodp's short help instead of torchrun's forty options."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        help_parser().print_help()
        parser.exit(0)


def help_parser(prog: str = "zerodp run") -> argparse.ArgumentParser:
    """A parser used only to document `zerodp run` (parsing goes through torchrun's parser)."""
    parser = argparse.ArgumentParser(
        prog=prog, usage=RUN_USAGE, description=RUN_DESCRIPTION, epilog=RUN_EPILOG
    )
    _add_nproc(parser)
    parser.add_argument("script", help="path of the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _add_nproc(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default=None,
        metavar="N",
        help="processes to start on this machine (default 1; also auto, cpu, gpu, xpu)",
    )


def _full_parser() -> argparse.ArgumentParser:
    """torchrun's parser with zerodp's `-n` and help; it decides where the script path is."""
    from torch.distributed.run import get_args_parser

    parser = _RaisingParser(
        prog="zerodp run",
        usage=RUN_USAGE,
        parents=[get_args_parser()],
        add_help=False,
        conflict_handler="resolve",
    )
    _add_nproc(parser)
    deepspeed_flags.add_flags(parser)
    parser.add_argument("-h", "--help", action=_HelpAction, help="show this help and exit")
    return parser


def _stripping_parser(wrapped: bool) -> argparse.ArgumentParser:
    """Recognises zerodp's own options (and DeepSpeed's launcher options), so everything
    else stays in order for torchrun; with `wrapped`, also how to run the script, which
    then goes to the `--local_rank` wrapper instead of torchrun."""
    parser = _RaisingParser(prog="zerodp run", add_help=False, allow_abbrev=False)
    _add_nproc(parser)
    deepspeed_flags.add_flags(parser)
    if wrapped:
        parser.add_argument("-m", "--module", action="store_true")
        parser.add_argument("--no-python", "--no_python", action="store_true")
    return parser


def _validated_nproc(value: str) -> str:
    if value in NPROC_KEYWORDS:
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise RunUsageError(
            f"-n/--nproc-per-node must be a positive number of processes "
            f"(or one of {', '.join(NPROC_KEYWORDS)}), got {value!r}"
        )
    return str(count)


def plan_run(argv: Sequence[str]) -> RunPlan:
    """Split `zerodp run` arguments into zerodp's, torchrun's and the script's.

    Raises RunUsageError (a ValueError) for a missing script, a bad process
    count, a missing script file, or a torchrun option torchrun rejects.
    """
    argv = list(argv)
    parser = _full_parser()
    parsed = parser.parse_args(argv)
    script: str = parsed.training_script
    script_args: list[str] = list(parsed.training_script_args)
    prefix = argv[: len(argv) - len(script_args) - 1]
    if argv[len(prefix)] != script:
        raise RunUsageError(f"could not locate the script path {script!r} on the command line")
    defaults = parser.parse_args([script])
    try:
        written = {arg.split("=", 1)[0] for arg in prefix if arg.startswith("-")}
        launch = deepspeed_flags.deepspeed_launch(parsed, defaults, written)
    except deepspeed_flags.LaunchError as error:
        raise RunUsageError(str(error)) from None
    wrapped = launch is not None and launch.pass_local_rank
    _, passthrough = _stripping_parser(wrapped).parse_known_args(prefix)
    given = parsed.nproc_per_node
    nproc = _validated_nproc(str(given or "1"))
    if launch is not None and launch.nproc is not None:
        if given is not None and nproc != launch.nproc:
            raise RunUsageError(
                f"-n {nproc} and DeepSpeed's flags ({launch.nproc} processes) disagree; "
                "give one of them"
            )
        nproc = launch.nproc
    takes_file = not (parsed.module or parsed.no_python)
    if takes_file and not os.path.isfile(script):
        raise RunUsageError(
            f"script not found: {script!r} (check the path, or use -m for a module)"
        )
    extra = list(launch.torchrun_args) if launch is not None else []
    multi_node = "--nnodes" in extra or any(
        getattr(parsed, field) != getattr(defaults, field) for field in _MULTI_NODE_FIELDS
    )
    head = [] if multi_node else ["--standalone"]
    target = [script, *script_args]
    if wrapped:
        mode = "module" if parsed.module else "exec" if parsed.no_python else "script"
        target = ["-m", deepspeed_flags.LOCAL_RANK_MODULE, "--as", mode, *target]
    torchrun_argv = [*head, "--nproc-per-node", nproc, *extra, *passthrough, *target]
    notes: tuple[str, ...] = ()
    if launch is not None and launch.no_effect:
        notes = (
            f"zerodp run: {', '.join(launch.no_effect)} tune DeepSpeed's own launcher and "
            "have no effect here",
        )
    return RunPlan(
        nproc_per_node=nproc,
        script=script,
        script_args=tuple(script_args),
        torchrun_argv=tuple(torchrun_argv),
        standalone_added=not multi_node,
        env=dict(launch.env) if launch is not None else {},
        notes=notes,
    )


def exit_status_of(error: BaseException) -> int:
    """The exit status to report for torchrun's ChildFailedError: the first failed rank's.

    A rank killed by a signal shows a negative exit code in torchrun; shells
    report that as 128 + signal number, and so does zerodp.
    """
    first_failure = getattr(error, "get_first_failure", None)
    if first_failure is None:
        return 1
    _, failure = first_failure()
    code = int(failure.exitcode)
    if code < 0:
        return 128 + (-code)
    return code if code > 0 else 1


def launch(plan: RunPlan) -> int:
    """Run torchrun in this process; return the script's exit status (0 when all ranks succeed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    for note in plan.notes:
        print(note, file=sys.stderr, flush=True)
    os.environ.update(plan.env)  # the workers inherit it
    try:
        torchrun_main(list(plan.torchrun_argv))
    except ChildFailedError as error:
        # torchrun's summary: which ranks failed, how, and the first failure (its root cause).
        print(str(error).strip(), file=sys.stderr, flush=True)
        return exit_status_of(error)
    except SignalException as error:
        # torchrun stopped the workers because this process was signalled.
        return 128 + int(error.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    return 0
