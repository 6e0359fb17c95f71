"""What `zerodp env` reports: the facts a bug report about a distributed run needs.

Most distributed-training bugs turn out to depend on the torch build, the
backends compiled in, the devices visible and a handful of environment
variables, so the report gathers exactly those. Optional packages are looked
up through their installed metadata rather than imported: importing
transformers or deepspeed just to print a version would be slow and could
fail for reasons unrelated to the report.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

import torch

from zerodp.version import __version__

ENV_VARS: tuple[str, ...] = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
"""Environment variables that change how a distributed run behaves."""

OPTIONAL_PACKAGES: tuple[str, ...] = (
    "pydantic",
    "numpy",
    "tqdm",
    "rich",
    "matplotlib",
    "tensorboard",
    "safetensors",
    "transformers",
    "deepspeed",
)
"""Distributions whose versions are reported when installed."""

_GIB = 1024**3


def collect_env() -> dict[str, Any]:
    """Gather the report as plain JSON-serialisable data (see `format_report` for text)."""
    return {
        "zerodp": __version__,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_build": _torch_build(),
        "distributed_backends": _distributed_backends(),
        "accelerators": _accelerators(),
        "cpus": _cpus(),
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "packages": _package_versions(OPTIONAL_PACKAGES),
    }


def _torch_build() -> dict[str, Any]:
    """Which accelerator toolkit torch was compiled against ("cpu" when none)."""
    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    if hip:
        kind = f"rocm {hip}"
    elif cuda:
        kind = f"cuda {cuda}"
    else:
        kind = "cpu"
    build: dict[str, Any] = {"kind": kind, "cuda": cuda, "hip": hip, "debug": torch.version.debug}
    if cuda and torch.backends.cudnn.is_available():
        build["cudnn"] = torch.backends.cudnn.version()
    nccl = _nccl_version()
    if nccl is not None:
        build["nccl"] = nccl
    return build


def _nccl_version() -> str | None:
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return str(version)


def _distributed_backends() -> dict[str, bool]:
    dist = torch.distributed
    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }


def _accelerators() -> list[dict[str, Any]]:
    """Visible accelerator devices with names and memory (empty on a CPU-only machine).

    CUDA (which also covers ROCm builds) reports names and memory; any other
    accelerator torch knows (XPU, MPS, ...) is listed by type and index.
    """
    devices: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "type": "cuda",
                    "index": index,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / _GIB, 2),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
        return devices
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return devices
    current = accelerator.current_accelerator()
    device_type = current.type if current is not None else "unknown"
    for index in range(accelerator.device_count()):
        devices.append({"type": device_type, "index": index, "name": None, "memory_gib": None})
    return devices


def _cpus() -> dict[str, int | None]:
    """Logical CPUs on the machine and how many this process may run on."""
    usable: int | None = None
    sched_getaffinity = getattr(os, "sched_getaffinity", None)
    if sched_getaffinity is not None:
        usable = len(sched_getaffinity(0))
    return {"logical": os.cpu_count(), "usable": usable, "torch_threads": torch.get_num_threads()}


def _package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def format_report(report: dict[str, Any]) -> str:
    """Render `collect_env()` output as aligned "key: value" lines for pasting into an issue."""
    lines = [
        f"zerodp version: {report['zerodp']}",
        f"Python: {report['python']} ({report['python_executable']})",
        f"Platform: {report['platform']}",
        f"torch: {report['torch']}",
        f"torch build: {report['torch_build']['kind']}",
    ]
    for key in ("cudnn", "nccl"):
        if key in report["torch_build"]:
            lines.append(f"  {key}: {report['torch_build'][key]}")
    backends = report["distributed_backends"]
    lines.append(
        "distributed backends: "
        + ", ".join(f"{name}={'yes' if ok else 'no'}" for name, ok in backends.items())
    )
    devices = report["accelerators"]
    lines.append(f"accelerators: {len(devices) if devices else 'none'}")
    for device in devices:
        memory = device.get("memory_gib")
        detail = f", {memory} GiB" if memory is not None else ""
        lines.append(f"  {device['type']}:{device['index']} {device.get('name') or ''}{detail}")
    cpus = report["cpus"]
    lines.append(
        f"CPUs: {cpus['logical']} logical, {cpus['usable']} usable, "
        f"torch threads {cpus['torch_threads']}"
    )
    lines.append("environment:")
    lines.extend(
        f"  {name}={value if value is not None else '<unset>'}"
        for name, value in report["env"].items()
    )
    lines.append("optional packages:")
    lines.extend(
        f"  {name}: {version if version is not None else 'not installed'}"
        for name, version in report["packages"].items()
    )
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> str:
    """The report as indented JSON (for tooling and for attaching to issues verbatim)."""
    return json.dumps(report, indent=2, sort_keys=False)
