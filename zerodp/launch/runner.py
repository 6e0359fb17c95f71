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
import shlex
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from zerodp.launch import deepspeed_flags, multinode_runner, remote_env
from zerodp.launch.torchrun_status import run_torchrun

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


@dataclass(frozen=True)
class HostsPlan:
    """What `zerodp run` starts on several hosts (`zerodp.launch.multinode_runner`)."""

    hosts: multinode_runner.HostLaunch
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


def plan_run(argv: Sequence[str]) -> RunPlan | HostsPlan:
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
    if launch is not None and launch.hosts is not None:
        return _hosts_plan(parsed, launch, launch.hosts, passthrough, wrapped)
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


# torchrun's rendezvous options, which the node agents write for each host themselves.
_RENDEZVOUS_OPTIONS = (
    ("--master-addr", "--master_addr"),
    ("--master-port", "--master_port"),
    ("--nnodes",),
    ("--node-rank", "--node_rank"),
    ("--rdzv-backend", "--rdzv_backend"),
    ("--rdzv-endpoint", "--rdzv_endpoint"),
    ("--rdzv-id", "--rdzv_id"),
    ("--rdzv-conf", "--rdzv_conf"),
)


def _hosts_plan(
    parsed: argparse.Namespace,
    launch: deepspeed_flags.DeepSpeedLaunch,
    several: deepspeed_flags.SeveralHosts,
    passthrough: list[str],
    wrapped: bool,
) -> HostsPlan:
    """A launch on several hosts: each host's torchrun arguments, or srun's / mpirun's."""
    if parsed.nproc_per_node is not None:
        raise RunUsageError(
            "-n/--nproc-per-node with a hostfile: each host runs one process per slot of the "
            "hostfile; choose them with --num_gpus, --include or --exclude"
        )
    stripper = _RaisingParser(add_help=False, allow_abbrev=False)
    for names in _RENDEZVOUS_OPTIONS:
        stripper.add_argument(*names, dest=names[0][2:].replace("-", "_"))
    stripper.add_argument("--standalone", action="store_true")
    stripped, rest = stripper.parse_known_args(passthrough)
    chosen = [name for name, value in vars(stripped).items() if value not in (None, False)]
    own = {"master_addr", "master_port"}
    if set(chosen) - own:
        raise RunUsageError(
            f"--{', --'.join(sorted(set(chosen) - own))}: with a hostfile zerodp starts every "
            "host and sets up its rendezvous; drop them (or start each host yourself with "
            "--no_ssh --node_rank R, as with DeepSpeed)"
        )
    target = [parsed.training_script, *parsed.training_script_args]
    direct = multinode_runner.direct_command(
        (["-m", deepspeed_flags.LOCAL_RANK_MODULE, "--as", _mode(parsed), *target])
        if wrapped
        else target,
        module=parsed.module and not wrapped,
        no_python=parsed.no_python and not wrapped,
    )
    if wrapped:
        target = ["-m", deepspeed_flags.LOCAL_RANK_MODULE, "--as", _mode(parsed), *target]
    if several.launcher != "pdsh" and (rest or launch.torchrun_args):
        raise RunUsageError(
            f"--launcher {several.launcher} starts the script itself, without torchrun: its "
            f"options {[*launch.torchrun_args, *rest]} have no place there"
        )
    try:
        hosts = multinode_runner.HostLaunch(
            several=several,
            node_args=(*launch.torchrun_args, *rest, *target),
            direct_command=tuple(direct),
            exports=remote_env.exported_environment(extra=launch.env),
            cwd=os.getcwd(),
            run_id=uuid.uuid4().hex[:12],
        )
        _check_installed(hosts)
    except deepspeed_flags.LaunchError as error:
        raise RunUsageError(str(error)) from None
    notes: tuple[str, ...] = ()
    if launch.no_effect:
        notes = (
            f"zerodp run: {', '.join(launch.no_effect)} tune DeepSpeed's own launcher and "
            "have no effect here",
        )
    return HostsPlan(hosts, notes)


def _mode(parsed: argparse.Namespace) -> str:
    return "module" if parsed.module else "exec" if parsed.no_python else "script"


def _check_installed(hosts: multinode_runner.HostLaunch) -> None:
    """srun and mpirun must be here, pdsh or ssh for `--launcher pdsh` (and pdsh for
    `--launcher_args`, which are its own); otherwise the error names what to do."""
    launcher = hosts.several.launcher
    if launcher == "pdsh":
        if shutil.which("pdsh"):
            return
        if not shutil.which("ssh"):
            raise deepspeed_flags.LaunchError(
                "neither pdsh nor ssh is installed here: zerodp run reaches the other hosts "
                "with one of them"
            )
        hosts.refuse_launcher_args_over_ssh()
        return
    command = hosts.srun_command() if launcher == "slurm" else hosts.mpirun_command()
    if shutil.which(command[0]) is None:
        where = "a node of the SLURM allocation" if launcher == "slurm" else "where Open MPI is"
        raise deepspeed_flags.LaunchError(
            f"--launcher {launcher}: {command[0]} is not installed here; run this on {where}:"
            f"\n  {shlex.join(command)}"
        )


def launch(plan: RunPlan | HostsPlan) -> int:
    """Run the plan; return the script's exit status (0 when all ranks succeed): torchrun in
    this process, or every host of a hostfile launch (`zerodp.launch.host_supervisor`)."""
    for note in plan.notes:
        print(note, file=sys.stderr, flush=True)
    if isinstance(plan, HostsPlan):
        from zerodp.launch.host_supervisor import launch_on_hosts

        try:
            return launch_on_hosts(plan.hosts)
        except deepspeed_flags.LaunchError as error:
            print(f"zerodp run: error: {error}", file=sys.stderr, flush=True)
            return 1
    os.environ.update(plan.env)  # the workers inherit it
    return run_torchrun(plan.torchrun_argv)
