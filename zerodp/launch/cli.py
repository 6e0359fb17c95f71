"""The `zerodp` command: `run` (launch through torchrun), `env` (bug-report facts), `consolidate`,
`convert deepspeed` (a DeepSpeed checkpoint as a zerodp one, and as safetensors).

`main` returns the exit status instead of calling `sys.exit`, so tests can
call it in-process; the console script passes the return value to
`sys.exit`. Usage errors exit with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zerodp.launch import runner
from zerodp.version import __version__

_DESCRIPTION = "zerodp: ZeRO data-parallel training for PyTorch."

_EPILOG = (
    "Run `zerodp SUBCOMMAND --help` for a subcommand's options. "
    "`zerodp run` passes any option it does not know (before the script path) to torchrun."
)

USAGE_ERROR = 2
"""Exit status for a command line that cannot be acted on (argparse's convention)."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; `run`'s own arguments are parsed by `zerodp.launch.runner`."""
    parser = argparse.ArgumentParser(prog="zerodp", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"zerodp {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    commands.add_parser(
        "run",
        help="start N local processes with torchrun: zerodp run -n N script.py [args]",
        add_help=False,
    )
    env = commands.add_parser("env", help="print versions, devices and settings for a bug report")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    consolidate = commands.add_parser(
        "consolidate",
        help="write one full fp32 state dict from a sharded checkpoint",
        description="Write one full fp32 state dict from a sharded zerodp checkpoint.",
    )
    consolidate.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="checkpoint directory")
    consolidate.add_argument("output", metavar="OUT", help="file to write the state dict to")
    consolidate.add_argument(
        "--tag", default=None, help="checkpoint tag to read (default: the latest one)"
    )
    consolidate.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksum check of the checkpoint's files (for trusted storage)",
    )
    convert = commands.add_parser(
        "convert",
        help="convert a DeepSpeed ZeRO checkpoint: zerodp convert deepspeed SRC DST [--hf DIR]",
        description=(
            "Write a zerodp checkpoint (and with --hf, Hugging Face safetensors) from a DeepSpeed "
            "ZeRO stage 1-3 or universal checkpoint. A training run can also load the DeepSpeed "
            "checkpoint directly with engine.load_checkpoint."
        ),
    )
    convert.add_argument("source_format", choices=["deepspeed"], help="the source's format")
    convert.add_argument("source", metavar="SRC", help="DeepSpeed's save directory or tag folder")
    convert.add_argument("destination", metavar="DST", help="directory for the zerodp checkpoint")
    convert.add_argument("--tag", default=None, help="tag to read (default: 'latest')")
    convert.add_argument("--hf", default=None, metavar="DIR", help="also write safetensors here")
    convert.add_argument(
        "--hf-dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of the safetensors"
    )
    convert.add_argument(
        "--max-shard-bytes", type=int, default=None, help="largest safetensors shard (5 GiB)"
    )
    return parser


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zerodp` console script; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "run":
        return _run(args[1:])
    parser = build_parser()
    try:
        namespace = parser.parse_args(args)
    except SystemExit as stop:  # --help, --version and argparse's usage errors
        return _exit_code(stop)
    if namespace.command == "env":
        return _env(as_json=namespace.json)
    if namespace.command == "consolidate":
        return _consolidate(
            namespace.checkpoint_dir, namespace.output, namespace.tag, not namespace.no_verify
        )
    if namespace.command == "convert":
        return _convert(namespace)
    parser.print_usage(sys.stderr)
    print("zerodp: error: choose a subcommand: run, env, consolidate or convert", file=sys.stderr)
    return USAGE_ERROR


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _run(argv: Sequence[str]) -> int:
    try:
        plan = runner.plan_run(argv)
    except runner.RunUsageError as error:
        print(f"usage: {runner.RUN_USAGE}", file=sys.stderr)
        print(f"zerodp run: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as stop:  # `zerodp run --help`
        return _exit_code(stop)
    sys.stdout.flush()
    return runner.launch(plan)


def _env(*, as_json: bool) -> int:
    from zerodp.launch import env_report

    report = env_report.collect_env()
    text = env_report.report_json(report) if as_json else env_report.format_report(report)
    print(text)
    return 0


def _consolidate(checkpoint_dir: str, output: str, tag: str | None, verify: bool) -> int:
    try:
        from zerodp.checkpoint_io.consolidate import consolidate_checkpoint
    except ImportError as error:
        print(
            "zerodp consolidate: error: this zerodp installation has no checkpoint "
            f"consolidation (zerodp.checkpoint_io.consolidate is not importable: {error})",
            file=sys.stderr,
        )
        return USAGE_ERROR
    from zerodp.errors import ZeroDPError

    try:
        written = consolidate_checkpoint(checkpoint_dir, output, tag=tag, verify_checksums=verify)
    except (ZeroDPError, ValueError, OSError) as error:
        print(f"zerodp consolidate: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote full fp32 state dict to {written}")
    return 0


def _convert(namespace: argparse.Namespace) -> int:
    import torch

    from zerodp.errors import ZeroDPError
    from zerodp.launch.convert import convert_deepspeed

    try:
        path, files = convert_deepspeed(
            namespace.source,
            namespace.destination,
            tag=namespace.tag,
            hf_dir=namespace.hf,
            hf_dtype=getattr(torch, _DTYPES[namespace.hf_dtype]),
            max_shard_bytes=namespace.max_shard_bytes,
        )
    except (ZeroDPError, ValueError, OSError) as error:
        print(f"zerodp convert: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote zerodp checkpoint {path}")
    if files:
        print(f"wrote {len(files)} safetensors file(s) under {namespace.hf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
