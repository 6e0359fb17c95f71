"""DeepSpeed's `deepspeed.comm` functions for scripts, over `torch.distributed`.

A DeepSpeed script calls `deepspeed.comm.get_rank()`, `all_reduce(t)`,
`barrier()` and friends; with `import zerodp as deepspeed` these are
`zerodp.comm.<name>`. Each is a thin call of the torch function of the same
name, with DeepSpeed's signature: groups are torch process groups (from
`new_group`), `async_op=True` returns torch's work handle (`wait()`,
`is_completed()`), `ReduceOp` is torch's, and DeepSpeed's profiling keywords
(`prof`, `log_name`, `debug`) are accepted and have no effect.

This module is the package's public face, not part of its internals: zerodp's
own collectives go through `Comm` (they count bytes and check failures), and
no zerodp module but `zerodp.comm`'s `__init__` imports this one (an import
contract in pyproject.toml). A script's own collectives interleave with the
engine's in program order on every rank, as they would in DeepSpeed.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm.launch_env import LAUNCHERS
from zerodp.comm.process_group import (
    default_device,
    destroy_process_group_if_owned,
    ensure_process_group,
    is_initialized,
)
from zerodp.comm.single_tensor import all_gather_single, reduce_scatter_single
from zerodp.errors import UnsupportedFeatureError, UsageError

__all__ = [
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "backend_name",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_local_rank_from_launcher",
    "get_rank",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup
P2POp = dist.P2POp

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
_PROFILING_KEYWORDS = frozenset({"prof", "log_name", "debug"})


# -- set-up ------------------------------------------------------------------------------


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Set up the default process group as zerodp does, with DeepSpeed's arguments.

    From torchrun's (or `zerodp run`'s, or DeepSpeed's launcher's) environment;
    a plain `python script.py` runs at world size 1. Under `mpirun` without those
    variables, Open MPI's and MPICH's rank variables are used, with
    `MASTER_ADDR` from the environment and `distributed_port` as the port.
    `dist_backend` may be the backend zerodp picks for this device (`gloo` on
    the CPU, `nccl` on CUDA; zerodp also keeps gloo for CPU tensors); any other
    is refused. `init_method` may be `env://` or `tcp://host:port` (with `rank`
    and `world_size`). `timeout` bounds every collective, as the config's
    `comms_timeout_s` does. `verbose` and `config` (DeepSpeed's comms logger)
    change nothing. Calling it again is a no-op, as in DeepSpeed.
    """
    del verbose, config
    if is_initialized():
        return
    if dist_init_required is False:
        raise UsageError(
            "init_distributed(dist_init_required=False): the process group is not set up; "
            "set it up first (torch.distributed.init_process_group) or leave "
            "dist_init_required at None"
        )
    _check_backend(dist_backend)
    _environment_from(init_method, rank, world_size)
    if auto_mpi_discovery:
        _environment_from_mpi(distributed_port)
    timeout_s = None if timeout is None else timeout.total_seconds()
    ensure_process_group(timeout_s)


def backend_name() -> str:
    """The backend zerodp uses for this process's device: gloo on the CPU, else the
    device's own (nccl on CUDA), beside gloo for CPU tensors."""
    device = default_device()
    if device.type == "cpu":
        return "gloo"
    return str(dist.Backend.default_device_backend_map.get(device.type, "gloo"))


def _check_backend(dist_backend: str | None) -> None:
    if dist_backend is None:
        return
    mine = backend_name()
    device = default_device()
    if dist_backend.lower() != mine and dist_backend != f"cpu:gloo,{device.type}:{mine}":
        raise UsageError(
            f"init_distributed(dist_backend={dist_backend!r}): zerodp uses {mine!r} on "
            f"{device.type} (and gloo for CPU tensors); pass dist_backend={mine!r} or None, "
            "or set ZERODP_DEVICE to train on another device"
        )


def _environment_from(init_method: str | None, rank: int, world_size: int) -> None:
    """`tcp://host:port` with `rank` and `world_size` as the environment torch reads."""
    if init_method in (None, "env://"):
        if rank >= 0 or world_size > 0:
            _set_consistent("RANK", rank)
            _set_consistent("WORLD_SIZE", world_size)
        return
    if not init_method.startswith("tcp://"):
        raise UsageError(
            f"init_distributed(init_method={init_method!r}): zerodp sets up the process group "
            "from the environment; use init_method='env://' (or 'tcp://host:port' with rank= "
            "and world_size=), or launch with zerodp run / torchrun"
        )
    host, _, port = init_method[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit() or rank < 0 or world_size <= 0:
        raise UsageError(
            f"init_distributed(init_method={init_method!r}, rank={rank}, "
            f"world_size={world_size}): a tcp:// init_method needs 'tcp://host:port' and "
            "rank >= 0 and world_size > 0"
        )
    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = port
    _set_consistent("RANK", rank)
    _set_consistent("WORLD_SIZE", world_size)
    os.environ.setdefault("LOCAL_RANK", "0")


def _set_consistent(name: str, value: int) -> None:
    if value < 0 or (name == "WORLD_SIZE" and value == 0):
        return
    current = os.environ.get(name)
    if current is not None and current != str(value):
        raise UsageError(
            f"init_distributed: {name.lower()}={value} but the environment says "
            f"{name}={current}; pass the launcher's value or leave it out"
        )
    os.environ[name] = str(value)


# (rank, world size, local rank) variables of the MPI launchers DeepSpeed discovers.
def _environment_from_mpi(distributed_port: int) -> None:
    """DeepSpeed's MPI discovery: `distributed_port` is the master port of an mpirun launch
    that sets none. The rest of the launcher's environment (ranks, sizes, the master's
    address, a partial environment's error) is read by `zerodp.comm.launch_env`, as for
    `zerodp.initialize`, when the process group is set up."""
    if "RANK" in os.environ or "MASTER_PORT" in os.environ:
        return
    if any(
        launcher.name.startswith("mpirun") and launcher.rank in os.environ for launcher in LAUNCHERS
    ):
        os.environ["MASTER_PORT"] = str(distributed_port)


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    """Destroy `group`, or with None the default group (and every group made from it)."""
    if group is None:
        destroy_process_group_if_owned()
        if is_initialized():  # set up by the script itself
            dist.destroy_process_group()
        return
    dist.destroy_process_group(group)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """A process group of `ranks`, made on every rank (a collective); torch's keywords pass."""
    _require_group()
    return dist.new_group(ranks, **kwargs)


def _require_group() -> None:
    if not is_initialized():
        raise UsageError(
            "the process group is not set up: call zerodp.init_distributed() (or "
            "zerodp.initialize) first"
        )


# -- who is where ---------------------------------------------------------------------


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (the default group when None); -1 outside it."""
    _require_group()
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The number of ranks in `group` (the default group when None)."""
    _require_group()
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it."""
    _require_group()
    return get_local_rank_from_launcher()


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The default group's rank of `group`'s rank `group_rank`."""
    _require_group()
    whole = group if group is not None else dist.group.WORLD
    if whole is None:
        raise RuntimeError("internal error: no default process group after set-up")
    return dist.get_global_rank(whole, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The default group's ranks that make up `group`, in `group`'s order."""
    _require_group()
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def get_world_group() -> Any:
    _require_group()
    return dist.group.WORLD


def get_local_rank_from_launcher() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))


def get_world_rank_from_launcher() -> int:
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def get_world_size_from_launcher() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


# -- collectives ------------------------------------------------------------------------


def _check_keywords(name: str, kwargs: dict[str, Any]) -> None:
    """DeepSpeed's profiling keywords are accepted (and change nothing); they are removed."""
    for keyword in _PROFILING_KEYWORDS:
        kwargs.pop(keyword, None)
    _require_group()


def _forward(torch_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch_fn` with DeepSpeed's profiling keywords dropped and a clear error before set-up.

    DeepSpeed's comm functions take torch's arguments, in torch's order, so they are
    torch's functions (`help()` shows torch's signature and documentation).
    """

    @functools.wraps(torch_fn)
    def forwarded(*args: Any, **kwargs: Any) -> Any:
        _check_keywords(torch_fn.__name__, kwargs)
        return torch_fn(*args, **kwargs)

    return forwarded


barrier = _forward(dist.barrier)
monitored_barrier = _forward(dist.monitored_barrier)
broadcast = _forward(dist.broadcast)
broadcast_object_list = _forward(dist.broadcast_object_list)
all_reduce = _forward(dist.all_reduce)
reduce = _forward(dist.reduce)
all_gather = _forward(dist.all_gather)
all_gather_object = _forward(dist.all_gather_object)
all_gather_into_tensor = _forward(all_gather_single)
allgather_fn = all_gather_into_tensor
reduce_scatter = _forward(dist.reduce_scatter)
reduce_scatter_tensor = _forward(reduce_scatter_single)
reduce_scatter_fn = reduce_scatter_tensor
all_to_all_single = _forward(dist.all_to_all_single)
all_to_all = _forward(dist.all_to_all)
gather = _forward(dist.gather)
scatter = _forward(dist.scatter)
send = _forward(dist.send)
recv = _forward(dist.recv)
isend = _forward(dist.isend)
irecv = _forward(dist.irecv)
batch_isend_irecv = _forward(dist.batch_isend_irecv)


def inference_all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, **kwargs: Any
) -> torch.Tensor:
    """DeepSpeed's inference all-reduce: a plain, synchronous all-reduce here."""
    _check_keywords("inference_all_reduce", kwargs)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Any:
    """All-reduce each tensor; with `async_op` the handle of the last (they complete in order)."""
    _check_keywords("all_reduce_coalesced", kwargs)
    handle = None
    for tensor in tensors:
        handle = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return handle


def all_gather_coalesced(
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """All-gather each input into its output; with `async_op` the handle of the last."""
    _require_group()
    handle = None
    for output, tensor in zip(output_tensors, input_tensors, strict=True):
        handle = all_gather_single(output, tensor, group=group, async_op=async_op)
    return handle


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed's comms-logger table; refused, with where zerodp keeps its counts."""
    raise UnsupportedFeatureError(
        "zerodp.comm.log_summary: DeepSpeed's comms logger is not in zerodp; engine.comm.stats "
        "counts the engine's collectives (bytes and calls per kind, per group)"
    )
