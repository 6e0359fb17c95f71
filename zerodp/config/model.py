"""The zerodp configuration as frozen pydantic models, one per JSON section.

Attribute names equal DeepSpeed's JSON keys so existing config files load
unchanged. The models hold exactly what zerodp honours; DeepSpeed keys that
change nothing here, legacy names and unimplemented features are handled by
`zerodp.config.deepspeed_keys` before validation, and "auto" values by
`zerodp.config.auto`. Every section forbids unknown keys: a misspelled key
silently falling back to a default is the most expensive config bug there is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from zerodp.config.batch import BatchSizes
from zerodp.config.errors import SectionRuleError, to_config_error
from zerodp.config.expert_parallel import ExpertParallelConfig
from zerodp.config.fields import (
    Bool,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Section,
    Str,
    StrList,
    choice,
    int_check,
)
from zerodp.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from zerodp.config.optimizer import AdamParams, OptimizerConfig, SGDParams
from zerodp.config.parallel_features import composition_problems
from zerodp.config.scheduler import (
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zerodp.config.tensor_parallel import TensorParallelConfig, precision_mismatch
from zerodp.errors import ConfigError

# Re-exported: code outside the config package imports the sections from here.
__all__ = [
    "AdamParams",
    "BF16Config",
    "CheckpointConfig",
    "CheckpointWriterConfig",
    "CompileConfig",
    "EigenvalueConfig",
    "FP16Config",
    "LeafModuleConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "SGDParams",
    "SchedulerConfig",
    "TensorParallelConfig",
    "TiledComputeConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "ZeroDPConfig",
    "ZeroOptimizationConfig",
]


def _null_is_section(value: Any) -> Any:
    """DeepSpeed's default for a block such as `checkpoint.writer` is null: the defaults."""
    return {} if value is None else value


def _null_is_empty(value: Any) -> Any:
    """DeepSpeed documents `output_path: null` for "the default"; zerodp's default is ""."""
    return "" if value is None else value


class LeafModuleConfig(Section):
    """`leaf_module`: stage 3 leaves by class name, module name (wildcards) or name suffix."""

    classes: StrList = ()
    names: StrList = ()
    name_suffixes: StrList = ()


class ZeroOptimizationConfig(Section):
    """The `zero_optimization` section: the stage and its tuning (not the whole config)."""

    stage: Annotated[Literal[0, 1, 2, 3], int_check(choices=(0, 1, 2, 3))] = 0
    reduce_bucket_size: PosInt = 500_000_000
    overlap_comm: Bool = True
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_max_live_parameters: PosInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    # zerodp's: stage 3 units: each repeated block gathered as one ("blocks") or one group per
    # module ("modules"); stage3_unit_numel > 0 takes precedence (units by size).
    stage3_units: Annotated[Literal["blocks", "modules"], choice(("blocks", "modules"))] = "blocks"
    stage3_unit_numel: NonNegInt = 0  # zerodp's: modules this small are gathered as one unit
    stage3_gather_16bit_weights_on_model_save: Bool = False
    leaf_module: LeafModuleConfig = LeafModuleConfig()
    stage3_check_order: Bool = True  # zerodp's: every rank issues stage 3 collectives alike
    # zerodp's: who steps a tensor for an optimizer that reads whole tensors (docs/optimizers.md)
    tensorwise_placement: Annotated[
        Literal["holders", "balanced"], choice(("holders", "balanced"))
    ] = "holders"
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    # Several nodes (docs/multi-node.md): shard within groups of this many consecutive ranks
    # and replicate across them (-1: shard over all ranks); hpZ's secondary group size at
    # stage 3 (1: off).
    mics_shard_size: Annotated[int, int_check(lo=-1)] = -1
    zero_hpz_partition_size: PosInt = 1

    @model_validator(mode="after")
    def _groups_fit_the_stage(self) -> ZeroOptimizationConfig:
        shard, hpz, stage = self.mics_shard_size, self.zero_hpz_partition_size, self.stage
        if shard == 0:
            raise SectionRuleError(
                ("mics_shard_size",),
                lambda k: (
                    f"config key '{k[0]}': got 0; allowed: -1 (shard over all ranks) or the "
                    "number of consecutive ranks in one shard group (e.g. the GPUs of a node)"
                ),
            )
        if shard > 0 and stage == 0:
            raise SectionRuleError(
                ("mics_shard_size", "stage"),
                lambda k: (
                    f"config key '{k[0]}': got {shard} at stage 0, which shards nothing (every "
                    f"rank keeps everything and gradients are all-reduced over all ranks): set "
                    f"'{k[1]}' to 1, 2 or 3 to shard within groups of {shard} ranks, or '{k[0]}' "
                    "to -1"
                ),
            )
        if hpz > 1 and stage != 3:
            raise SectionRuleError(
                ("zero_hpz_partition_size", "stage"),
                lambda k: (
                    f"config key '{k[0]}': got {hpz} at stage {stage}; hpZ keeps a secondary "
                    f"copy of stage 3's sharded parameters (stages 0-2 keep them whole): set "
                    f"'{k[1]}' to 3, or '{k[0]}' to 1"
                ),
            )
        if hpz > 1 and shard > 0 and shard % hpz != 0:
            raise SectionRuleError(
                ("zero_hpz_partition_size", "mics_shard_size"),
                lambda k: (
                    f"config key '{k[0]}': got {hpz}, which does not divide '{k[1]}' ({shard}); "
                    f"hpZ's secondary groups lie inside a shard group: set '{k[0]}' to a "
                    f"divisor of {shard}"
                ),
            )
        offload = self.offload_param
        if hpz > 1 and offload is not None and offload.device != "none":
            raise SectionRuleError(
                ("zero_hpz_partition_size", "offload_param.device"),
                lambda k: (
                    f"config key '{k[0]}': got {hpz} with '{k[1]}' {offload.device!r}; hpZ keeps "
                    "a secondary copy of the parameters on the device, which parameter offload "
                    f"moves off it: set '{k[0]}' to 1, or '{k[1]}' to \"none\""
                ),
            )
        return self

    @model_validator(mode="after")
    def _offload_fits_the_stage(self) -> ZeroOptimizationConfig:
        param, optimizer = self.offload_param, self.offload_optimizer
        stage = self.stage
        if param is not None and param.device != "none" and stage != 3:
            raise SectionRuleError(
                ("offload_param.device", "stage"),
                lambda k: (
                    f"config key '{k[0]}': got {param.device!r} at stage {stage}; parameter "
                    f"offload needs the sharded parameters of stage 3: set '{k[1]}' to 3, or "
                    f"'{k[0]}' to \"none\" (use offload_optimizer to move optimizer state)"
                ),
            )
        if optimizer is not None and optimizer.device != "none" and stage == 0:
            raise SectionRuleError(
                ("offload_optimizer.device", "stage"),
                lambda k: (
                    f"config key '{k[0]}': got {optimizer.device!r} at stage 0; optimizer "
                    f"offload moves each rank's shard of the optimizer state: set '{k[1]}' "
                    "to 1, 2 or 3"
                ),
            )
        for name, section in (("offload_param", param), ("offload_optimizer", optimizer)):
            if section is not None and section.device == "nvme" and not section.nvme_path:
                raise SectionRuleError(
                    (f"{name}.nvme_path",),
                    lambda k: (
                        f"config key '{k[0]}' is missing: NVMe offload needs the directory its "
                        "files go in (a local disk every rank can write), e.g. "
                        '"nvme_path": "/local_nvme"'
                    ),
                )
        return self


ZeroConfig = ZeroOptimizationConfig  # the name before 0.2; kept for existing imports


class BF16Config(Section):
    enabled: Bool = False


class FP16Config(Section):
    enabled: Bool = False
    loss_scale: NonNegFloat = 0.0  # 0 selects dynamic loss scaling
    initial_scale_power: NonNegInt = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: Bool = False  # refill the hysteresis budget after every clean step
    min_loss_scale: PosFloat = 1.0


class TiledComputeConfig(Section):
    """`tiled_compute` (zerodp's key): a Hugging Face causal LM's MLPs and its logits and
    loss computed a tile of tokens at a time (docs/sequence-parallel.md, [Note: tiled
    compute]); `tile_tokens` 0: the model's hidden size."""

    mlp: Bool = False
    logits_loss: Bool = False
    tile_tokens: NonNegInt = 0

    @property
    def enabled(self) -> bool:
        return self.mlp or self.logits_loss


class CompileConfig(Section):
    """`compile`: torch.compile the model (stages 0-2) or each of its blocks (stage 3).

    `enabled`, `backend` and `kwargs` (passed to `torch.compile`) are DeepSpeed's keys;
    `per_block` is zerodp's (null: per block at stage 3, the whole model otherwise).
    """

    enabled: Bool = False
    backend: Str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    per_block: Bool | None = None


class CheckpointWriterConfig(Section):
    """`checkpoint.writer`: `decoupled` (DeepSpeed's key): `save_checkpoint` returns once
    the states are copied to host memory and the files are written while training goes on
    (docs/checkpoints.md, [Note: decoupled save]). DeepSpeed's I/O knobs beside it are
    handled by `zerodp.config.deepspeed_keys`."""

    decoupled: Bool = False


class CheckpointConfig(Section):
    """`checkpoint`: how checkpoints are written (`writer`) and which `latest` file a load
    without a tag reads (`load_universal`: DeepSpeed's `latest_universal`). DeepSpeed's
    other keys are handled by `zerodp.config.deepspeed_keys`."""

    writer: Annotated[CheckpointWriterConfig, BeforeValidator(_null_is_section)] = Field(
        default_factory=CheckpointWriterConfig
    )
    load_universal: Bool = False


class MonitorConfig(Section):
    enabled: Bool = False
    output_path: Annotated[Str, BeforeValidator(_null_is_empty)] = ""
    job_name: Str = "zerodp_job"


class EigenvalueConfig(Section):
    enabled: Bool = False
    max_iter: PosInt = 100
    tol: PosFloat = 1e-2
    stability: NonNegFloat = 1e-6
    gas_boundary_resolution: PosInt = 1
    layer_name: Str = ""
    layer_num: NonNegInt = 0


class ZeroDPConfig(Section):
    """The whole config. Build it with `load_config`, which also resolves batch sizes.

    Constructed directly, the three batch-size keys may be None; `load_config`
    returns a copy in which all three are ints consistent with the world size.
    Construction raises `ConfigError`, never pydantic's exception type.
    """

    def __init__(self, **data: Any) -> None:
        # Only the root overrides __init__: pydantic calls a custom __init__ for
        # nested models too, which would flatten their errors into one string.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise to_config_error(exc, type(self)) from None

    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    # DeepSpeed 0.19.3+ clips at 1.0 unless told otherwise (0 turns clipping off).
    gradient_clipping: NonNegFloat = 1.0
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig)
    steps_per_print: PosInt = 10
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp16: FP16Config = Field(default_factory=FP16Config)
    communication_data_type: (
        Annotated[Literal["fp32", "fp16", "bf16"], choice(("fp32", "fp16", "bf16"))] | None
    ) = None
    # Ulysses sequence parallelism (docs/sequence-parallel.md): each sequence split over this
    # many consecutive ranks; with more than one, gradients are reduced in
    # seq_parallel_communication_data_type (DeepSpeed's rule and default) instead of
    # communication_data_type.
    sequence_parallel_size: PosInt = 1
    seq_parallel_communication_data_type: Annotated[
        Literal["fp32", "fp16", "bf16"], choice(("fp32", "fp16", "bf16"))
    ] = "fp32"
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    tiled_compute: TiledComputeConfig = Field(default_factory=TiledComputeConfig)
    dataloader_drop_last: Bool = False
    seed: NonNegInt | None = None
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # zerodp's own keys (not DeepSpeed's): see docs/configuration.md.
    comms_timeout_s: PosFloat | None = None  # None: $ZERODP_COMMS_TIMEOUT_S, else torch's default
    comms_stall_checks: Bool = True  # gloo: a wait that lasts hears failures, uneven inputs
    on_non_finite: Annotated[
        Literal["warn", "skip", "raise"], choice(("warn", "skip", "raise"))
    ] = "warn"

    @model_validator(mode="after")
    def _one_half_precision(self) -> ZeroDPConfig:
        if self.bf16.enabled and self.fp16.enabled:
            raise SectionRuleError(
                ("bf16.enabled", "fp16.enabled"),
                lambda k: (
                    f"config keys '{k[0]}' and '{k[1]}' are both true; allowed: at most one "
                    "half-precision mode; set one of them to false"
                ),
            )
        return self

    @model_validator(mode="after")
    def _dimensions_compose(self) -> ZeroDPConfig:
        """Every pair the composition table refuses ([Note: composition table])."""
        problems = composition_problems(self)
        if problems:
            raise SectionRuleError((), lambda k: "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _tensor_parallel_precision(self) -> ZeroDPConfig:
        mismatch = precision_mismatch(self.tensor_parallel, self.bf16.enabled, self.fp16.enabled)
        if mismatch is not None:
            raise SectionRuleError(("tensor_parallel",), lambda k: mismatch)
        return self

    @model_validator(mode="after")
    def _tiles_not_compiled(self) -> ZeroDPConfig:
        if self.tiled_compute.enabled and self.compile.enabled:
            raise SectionRuleError(
                ("tiled_compute", "compile.enabled"),
                lambda k: (
                    f"config key '{k[0]}' turns tiling on with '{k[1]}' true: zerodp does not "
                    f"compile tiled modules; set '{k[1]}' to false, or '{k[0]}.mlp' and "
                    f"'{k[0]}.logits_loss' to false"
                ),
            )
        return self

    @property
    def batch_sizes(self) -> BatchSizes:
        """The resolved batch sizes as plain ints, for code that wants them typed as such."""
        t, m, g = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        if t is None or m is None or g is None:
            raise ConfigError(
                "batch sizes are not resolved; build the config with "
                "zerodp.config.load_config(config, world_size=...)"
            )
        return BatchSizes(t, m, g)
