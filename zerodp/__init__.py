"""zerodp: ZeRO data parallelism for PyTorch, exact for every way of calling backward."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from zerodp import accelerator, checkpointing, comm, old_paths, ops, utils, zero
from zerodp.backward.step_gate import GradientState
from zerodp.comm import (
    current_rank,
    current_world_size,
    ensure_process_group,
    init_distributed,
    is_initialized,
)
from zerodp.comm.launch_env import adopt_launch_env
from zerodp.compat import add_config_arguments
from zerodp.compat.arguments import (
    config_from_arguments,
    deepspeed_argument_order,
    refuse_deepspeed_arguments,
    sync_local_rank,
)
from zerodp.compat.unsupported import missing_attribute
from zerodp.config import ZeroDPConfig, load_config
from zerodp.config.hints import hints_from_arguments
from zerodp.engine import ZeroEngine
from zerodp.engine.startup_checks import RankMismatchError
from zerodp.errors import (
    AgreedError,
    CheckpointError,
    CheckpointPathError,
    CheckpointStorageError,
    CollectiveError,
    ConfigError,
    ConfigWarning,
    DivergenceError,
    LifecycleError,
    LossScaleError,
    NonFiniteError,
    NonScalarLossError,
    ParamStateError,
    PeerFailedError,
    UnevenInputsError,
    UnsupportedFeatureError,
    UnsupportedModuleError,
    UsageError,
    ZeroDPError,
)
from zerodp.optim.tensorwise import declare_elementwise
from zerodp.posttrain import EngineMode, OffloadDeviceEnum, OffloadStateTypeEnum
from zerodp.version import __version__

# Old import paths (`zerodp.gathered`, `zerodp.data`, ...) keep working or name the new one.
old_paths.install()

__all__ = [
    "AgreedError",
    "CheckpointError",
    "CheckpointPathError",
    "CheckpointStorageError",
    "CollectiveError",
    "ConfigError",
    "ConfigWarning",
    "DivergenceError",
    "EngineMode",
    "GradientState",
    "LifecycleError",
    "LossScaleError",
    "NonFiniteError",
    "NonScalarLossError",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ParamStateError",
    "PeerFailedError",
    "RankMismatchError",
    "UnevenInputsError",
    "UnsupportedFeatureError",
    "UnsupportedModuleError",
    "UsageError",
    "ZeroDPConfig",
    "ZeroDPError",
    "ZeroEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "declare_elementwise",
    "init_distributed",
    "initialize",
    "ops",
    "utils",
    "zero",
]

DeepSpeedEngine = ZeroEngine  # DeepSpeed's name, for `isinstance(model, deepspeed.DeepSpeedEngine)`


if not TYPE_CHECKING:  # hidden from type checkers, which would accept any zerodp.<name>

    def __getattr__(name: str) -> Any:
        """`zerodp.gathered` and the other old root modules, when accessed as attributes;
        DeepSpeed's names zerodp does not implement raise with the zerodp alternative."""
        if f"{__name__}.{name}" in old_paths.MOVED:
            return old_paths.root_attribute(name)
        # Called from here directly: it reads the importing frame two levels up.
        missing_attribute(__name__, name)


def initialize(
    model: Any = None,
    config: Any = None,
    model_parameters: Iterable[Any] | None = None,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    *,
    args: Any = None,
    config_params: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    mesh_param: Any = None,
) -> tuple[ZeroEngine, Any, Any, Any]:
    """Wrap `model` in a ZeRO engine; returns (engine, optimizer, dataloader, lr_scheduler).

    `optimizer` is a torch optimizer built on the model's parameters, a list of them
    (each on its own parameters: torch's Muon for the matrices and AdamW for the
    rest), a callable(param_groups) -> optimizer, or None for the config's block.

    `config` is a dict, a path to a JSON file, or a ZeroDPConfig (DeepSpeed's
    `config_params` is accepted as an alias), or the path in `args.deepspeed_config`
    (DeepSpeed's flag, see `add_config_arguments`); a config given twice is an error.
    DeepSpeed's positional order `initialize(args, model, optimizer, model_parameters,
    training_data, lr_scheduler)` is recognised by its first two arguments.
    `distributed_port` is for DeepSpeed's MPI discovery (see `init_distributed`);
    `mpu` and `mesh_param` (model and sequence parallelism) are refused. The process
    group is set up from torchrun's environment when it is not up yet; the config
    is validated first, on every rank, so a bad config fails everywhere before any
    collective.

    "auto" values (as the HF Trainer writes them) are filled from the other
    arguments: the micro batch from a DataLoader passed as `training_data`
    (the engine then shards its dataset itself), optimizer settings from an
    optimizer instance, bucket sizes from the model's hidden size, fp16/bf16
    from the model's dtype. DeepSpeed keys that change nothing in zerodp are
    listed in one warning on rank 0.
    """
    if args is None and deepspeed_argument_order(model, config):
        args, model, optimizer, model_parameters, training_data, lr_scheduler, config = (
            model, config, model_parameters, optimizer, lr_scheduler, training_data, None
        )  # fmt: skip
    if model is None:
        raise ValueError("zerodp.initialize needs model=")
    del distributed_port  # DeepSpeed reads it only to discover an MPI launch
    refuse_deepspeed_arguments(mpu, mesh_param, dist_init_required)
    config = config_from_arguments(args, config, config_params)
    if config is None:
        raise ValueError("zerodp.initialize needs config= (a dict or a path to a JSON file)")
    if is_initialized():
        world_size, rank = current_world_size(), current_rank()
    else:
        # Validate before setting up the process group: the launcher announced the size
        # (torchrun's variables, or those of srun or mpirun, written as torchrun's).
        world_size = adopt_launch_env().world_size
        rank = int(os.environ.get("RANK", "0"))
    hints = hints_from_arguments(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        world_size=world_size,
    )
    resolved = load_config(config, world_size=world_size, hints=hints, rank=rank)
    training_data, collate_fn = _unwrap_loader(training_data, collate_fn)
    ensure_process_group(resolved.comms_timeout_s)
    sync_local_rank(args)
    engine = ZeroEngine(
        module=model,
        config=resolved,
        model_parameters=model_parameters,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    if engine.mode is EngineMode.INFERENCE:  # no optimizer, no scheduler (as DeepSpeed)
        return engine, None, engine.training_dataloader, None
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _unwrap_loader(
    training_data: Any, collate_fn: Callable[[list[Any]], Any] | None
) -> tuple[Any, Callable[[list[Any]], Any] | None]:
    """A DataLoader's dataset and collate_fn: the engine builds its own sharded loader."""
    from torch.utils.data import DataLoader

    if not isinstance(training_data, DataLoader):
        return training_data, collate_fn
    return training_data.dataset, collate_fn or training_data.collate_fn
