"""DeepSpeed keys that change nothing in zerodp: accepted, type-checked, then dropped.

Each entry says why the key has no effect here. Most of them configure
something zerodp always does one way (it always reduce-scatters, always
keeps fp32 masters) or a DeepSpeed subsystem zerodp has no counterpart for
(timers, profilers). `same` says which values ask for what zerodp does
anyway; any other value gets `differs` in the warning, so a config that asks
for behaviour zerodp lacks says so instead of passing silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerodp.config.compat.deepcompile import DEEPCOMPILE_KNOBS
from zerodp.config.compat.kinds import (
    ANY,
    BOOL,
    INT,
    LIST,
    NUMBER,
    STR,
    Kind,
    block,
    nullable,
)


def _always(value: Any) -> bool:
    return True


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def _not_enabled(value: Any) -> bool:
    return isinstance(value, dict) and not value.get("enabled", False)


def _all_false(value: Any) -> bool:
    return isinstance(value, dict) and not any(
        v for k, v in value.items() if k != "number_checkpoints"
    )


@dataclass(frozen=True)
class Ignored:
    path: str
    kind: Kind
    why: str  # why the key changes nothing in zerodp
    same: Callable[[Any], bool] = _always  # the values that ask for what zerodp does anyway
    differs: str = ""  # what to tell a config whose value asks for something else


_FP16_ONLY = "bf16 needs no loss scaling (an fp16 key)"
_NO_OFFLOAD = "a tuning of DeepSpeed's CPU offload; zerodp's offload needs none"
_TORCH_PROFILER = "use torch.profiler"

IGNORED: tuple[Ignored, ...] = (
    # --- top level --------------------------------------------------------------------
    Ignored(
        "wall_clock_breakdown",
        BOOL,
        "zerodp has no phase timers",
        _is(False),
        f"zerodp does not time forward/backward/step; {_TORCH_PROFILER}",
    ),
    Ignored(
        "dump_state",
        BOOL,
        "zerodp prints no engine state at start-up",
        _is(False),
        "zerodp does not print its state; print(engine.config) shows the resolved config",
    ),
    Ignored(
        "memory_breakdown",
        BOOL,
        "zerodp logs no per-step memory breakdown",
        _is(False),
        "zerodp does not log memory; use torch.cuda.memory_summary()",
    ),
    Ignored(
        "prescale_gradients",
        BOOL,
        "zerodp divides the reduced gradient sum by the world size",
        _is(False),
        "zerodp does not scale gradients before the reduction; it divides the sum after it",
    ),
    Ignored(
        "gradient_predivide_factor",
        NUMBER,
        "zerodp divides the reduced gradient sum by the world size, once",
        _is(1.0),
        "zerodp does not predivide; if fp16 sums overflow, use bf16 or "
        'communication_data_type "fp32"',
    ),
    Ignored(
        "sparse_gradients",
        BOOL,
        "zerodp reduces embedding gradients dense",
        _is(False),
        "zerodp has no sparse gradient reduction; embedding gradients are reduced dense",
    ),
    Ignored(
        "zero_allow_untested_optimizer",
        BOOL,
        "zerodp needs no untested-optimizer opt-in (it shards any elementwise torch optimizer)",
    ),
    Ignored(
        "zero_force_ds_cpu_optimizer",
        BOOL,
        "zerodp has no DeepSpeed CPU optimizer to force",
    ),
    Ignored(
        "managed_gradient_accumulation",
        BOOL,
        "zerodp tracks micro-steps and steps at the accumulation boundary itself",
        _is(True),
        "zerodp has no client-managed accumulation: call engine.step() after every micro-batch",
    ),
    Ignored(
        "disable_python_gc",
        BOOL,
        "zerodp leaves Python's garbage collector alone",
        _is(False),
        "zerodp does not disable the garbage collector; call gc.disable() yourself",
    ),
    Ignored(
        "graph_harvesting",
        BOOL,
        "zerodp captures no CUDA graphs",
        _is(False),
        "zerodp does not capture the optimizer step in a CUDA graph",
    ),
    Ignored(
        "vocabulary_size",
        INT,
        "DeepSpeed only uses it for a Tensor Core alignment warning",
    ),
    Ignored(
        "seq_parallel_communication_data_type",
        STR,
        "zerodp has no sequence parallelism",
    ),
    Ignored(
        "use_data_before_expert_parallel_",
        BOOL,
        "zerodp has no expert parallelism",
    ),
    Ignored(
        "timers",
        block(throughput=ANY),
        "zerodp has no throughput timers",
    ),
    Ignored(
        "flops_profiler",
        block(
            enabled=BOOL,
            recompute_fwd_factor=NUMBER,
            profile_step=INT,
            module_depth=INT,
            top_modules=INT,
            detailed=BOOL,
            output_file=nullable(STR),
        ),
        "zerodp has no FLOPS profiler",
        _not_enabled,
        "zerodp does not profile FLOPs; use torch.profiler.profile(with_flops=True) or "
        "torch.utils.flop_counter.FlopCounterMode",
    ),
    Ignored(
        "comms_logger",
        block(enabled=BOOL, verbose=BOOL, prof_all=BOOL, debug=BOOL, prof_ops=LIST),
        "zerodp has no collective logger",
        _not_enabled,
        f"zerodp does not log collectives; {_TORCH_PROFILER} (it records them)",
    ),
    Ignored(
        "activation_checkpointing",
        block(
            partition_activations=BOOL,
            cpu_checkpointing=BOOL,
            contiguous_memory_optimization=BOOL,
            number_checkpoints=nullable(INT),
            synchronize_checkpoint_boundary=BOOL,
            profile=BOOL,
        ),
        "it configures deepspeed.checkpointing, which zerodp does not provide",
        _all_false,
        "zerodp does not partition, offload or profile checkpointed activations; use "
        "torch.utils.checkpoint (it works at every stage)",
    ),
    Ignored(
        "data_types",
        block(grad_accum_dtype=nullable(STR)),
        "zerodp accumulates gradients in fp32 when gradient_accumulation_steps > 1, "
        "in the model's dtype otherwise",
        lambda v: isinstance(v, dict) and v.get("grad_accum_dtype") in (None, "fp32"),
        "zerodp has no setting for the accumulation dtype (fp32 when accumulating)",
    ),
    Ignored(
        "cuda_visible_devices",
        ANY,
        "not a DeepSpeed key (DeepSpeed ignores it too); choose devices with the "
        "CUDA_VISIBLE_DEVICES environment variable",
    ),
    Ignored("optimizer.legacy_fusion", BOOL, "zerodp uses torch.optim's implementations"),
    # --- precision -----------------------------------------------------------------------
    Ignored(
        "fp16.auto_cast",
        BOOL,
        "zerodp casts floating inputs to fp16",
        _is(True),
        "zerodp casts floating inputs to fp16 anyway (a forward pre-hook)",
    ),
    Ignored(
        "fp16.fp16_master_weights_and_grads",
        BOOL,
        "zerodp keeps fp32 master weights and gradients",
        _is(False),
        "zerodp keeps fp32 masters (2 + 2 + 12 bytes per parameter)",
    ),
    Ignored(
        "bf16.bf16_master_weights_and_grads",
        BOOL,
        "zerodp keeps fp32 master weights",
        _is(False),
        "zerodp keeps fp32 masters (2 + 2 + 12 bytes per parameter)",
    ),
    Ignored(
        "bf16.bf16_optimizer_states",
        BOOL,
        "zerodp keeps optimizer state in fp32",
        _is(False),
        "zerodp keeps optimizer state in fp32",
    ),
    Ignored(
        "bf16.immediate_grad_update",
        BOOL,
        "zerodp moves each gradient into its reduction buffer as it is produced",
    ),
    Ignored(
        "bf16.check_grad_overflow",
        BOOL,
        "zerodp checks for inf/NaN gradients under fp16 loss scaling only",
        _is(False),
        "zerodp does not check bf16 gradients for overflow",
    ),
    Ignored("bf16.loss_scale", NUMBER, _FP16_ONLY),
    Ignored("bf16.initial_scale_power", INT, _FP16_ONLY),
    Ignored("bf16.loss_scale_window", INT, _FP16_ONLY),
    Ignored("bf16.hysteresis", INT, _FP16_ONLY),
    Ignored("bf16.consecutive_hysteresis", BOOL, _FP16_ONLY),
    Ignored("bf16.min_loss_scale", NUMBER, _FP16_ONLY),
    Ignored("bf16.auto_cast", BOOL, "zerodp casts floating inputs to bf16"),
    # --- zero_optimization ---------------------------------------------------------------
    Ignored(
        "zero_optimization.allgather_partitions",
        BOOL,
        "zerodp all-gathers the updated shards after each step",
        _is(True),
        "zerodp has no broadcast-based parameter update; it all-gathers",
    ),
    Ignored(
        "zero_optimization.mics_hierarchical_params_gather",
        BOOL,
        "a shard group gathers with one all-gather (its backend follows the topology)",
        _is(False),
        "zerodp has no two-step (across nodes, then within each) gather",
    ),
    Ignored(
        "zero_optimization.allgather_bucket_size",
        INT,
        "zerodp all-gathers each flat group whole; zero_optimization.reduce_bucket_size "
        "sizes the groups",
    ),
    Ignored(
        "zero_optimization.reduce_scatter",
        BOOL,
        "zerodp always reduce-scatters gradients at stages 1-3 (all-reduce at stage 0)",
        _is(True),
        "zerodp has no all-reduce variant of stages 1-3",
    ),
    Ignored(
        "zero_optimization.contiguous_gradients",
        BOOL,
        "zerodp always reduces gradients through contiguous flat buffers",
        _is(True),
        "zerodp cannot turn contiguous gradient buffers off",
    ),
    Ignored(
        "zero_optimization.compute_grad_norm",
        BOOL,
        "zerodp computes the global gradient norm at every step",
        _is(True),
        "zerodp always computes it (for clipping and get_global_grad_norm())",
    ),
    Ignored(
        "zero_optimization.load_from_fp32_weights",
        BOOL,
        "zerodp checkpoints hold the fp32 master weights, and loading restores them",
        _is(True),
        "zerodp always restores the fp32 masters from the checkpoint",
    ),
    Ignored(
        "zero_optimization.grad_hooks",
        BOOL,
        "zerodp always reduces from gradient hooks during backward",
        _is(True),
        "zerodp cannot defer stage-1 reduction hooks",
    ),
    Ignored("zero_optimization.round_robin_gradients", BOOL, _NO_OFFLOAD),
    *(
        Ignored(f"zero_optimization.offload_optimizer.{key}", kind, _NO_OFFLOAD)
        for key, kind in (
            ("buffer_count", INT),
            ("fast_init", BOOL),
            ("pipeline_read", BOOL),
            ("pipeline_write", BOOL),
            ("pipeline", BOOL),
            ("super_offload", BOOL),
            ("convert_grad_on_cpu", BOOL),
            ("cpuadam_cores_perc", NUMBER),
        )
    ),
    *(
        Ignored(f"zero_optimization.offload_param.{key}", INT, _NO_OFFLOAD)
        for key in ("buffer_count", "buffer_size", "max_in_cpu")
    ),
    Ignored(
        "aio",
        block(
            block_size=INT,
            queue_depth=INT,
            intra_op_parallelism=INT,
            thread_count=INT,
            single_submit=BOOL,
            overlap_events=BOOL,
            use_gds=BOOL,
        ),
        "zerodp's NVMe offload reads and writes through the operating system's page cache, "
        "with its own I/O threads; DeepSpeed's libaio settings have no counterpart",
    ),
    Ignored(
        "zero_optimization.parameter_alignment",
        BOOL,
        "zerodp packs parameters without alignment padding",
        _is(False),
        "zerodp does not pad parameters to 16-byte boundaries",
    ),
    Ignored(
        "zero_optimization.sub_group_size",
        INT,
        "zerodp steps each rank's shards in one optimizer call; there are no sub-groups",
    ),
    Ignored(
        "zero_optimization.elastic_checkpoint",
        BOOL,
        "zerodp checkpoints load at any world size and stage",
    ),
    Ignored(
        "zero_optimization.stage3_model_persistence_threshold",
        INT,
        "zerodp bounds persistence by stage3_param_persistence_threshold only",
    ),
    Ignored(
        "zero_optimization.stage3_module_granularity_threshold",
        INT,
        "zerodp gathers parameters per module; it fuses no fine-grained modules",
    ),
    Ignored(
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        BOOL,
        "zerodp gathers stage 3 parameters with all-gather",
        _is(False),
        "zerodp has no all-reduce parameter fetch",
    ),
    Ignored(
        "zero_optimization.stage3_allgather_sequential",
        BOOL,
        "zerodp gathers each flat group in one all-gather",
    ),
    Ignored(
        "zero_optimization.stage3_partition_stream_chunk_size",
        INT,
        "zerodp partitions each parameter group whole at start-up",
    ),
    Ignored(
        "zero_optimization.use_multi_rank_bucket_allreduce",
        BOOL,
        "zerodp reduces each bucket with one collective; it does not merge ranks' buckets",
    ),
    Ignored(
        "zero_optimization.memory_efficient_linear",
        BOOL,
        "zerodp uses torch's own Linear; stage 3 gathers weights through module hooks",
    ),
    Ignored(
        "zero_optimization.pipeline_loading_checkpoint",
        BOOL,
        "zerodp has no pipeline mode",
        _is(False),
        "zerodp has no pipeline mode to load checkpoints in",
    ),
    Ignored(
        "zero_optimization.override_module_apply",
        BOOL,
        "zerodp does not patch nn.Module.apply",
    ),
    Ignored(
        "zero_optimization.log_trace_cache_warnings",
        BOOL,
        "zerodp's prefetch trace has no cache warnings",
    ),
    Ignored(
        "zero_optimization.enable_sanity_checks",
        BOOL,
        "zerodp's internal checks always run",
    ),
    Ignored(
        "zero_optimization.save_muon_momentum_buffer_in_memory",
        BOOL,
        "zerodp keeps Muon's momentum with the rest of the optimizer state (in memory, or on the "
        "host with optimizer offload)",
    ),
    Ignored(
        "zero_optimization.ignore_unused_parameters",
        BOOL,
        "zerodp trains models with unused parameters",
        _is(True),
        "zerodp never raises for unused parameters",
    ),
    Ignored(
        "zero_optimization.legacy_stage1",
        BOOL,
        "zerodp has one stage 1 implementation",
        _is(False),
        "zerodp has no legacy stage 1",
    ),
    # --- checkpoint, eigenvalue -------------------------------------------------------------
    Ignored(
        "checkpoint.tag_validation",
        STR,
        "zerodp does not compare checkpoint tags across ranks",
        lambda v: isinstance(v, str) and v.lower() == "ignore",
        "zerodp does not check that ranks pass the same tag; pass the same tag on every rank",
    ),
    Ignored(
        "checkpoint.load_universal",
        BOOL,
        "zerodp checkpoints load at any world size and stage",
    ),
    Ignored(
        "eigenvalue.verbose",
        BOOL,
        "zerodp reports eigenvalues through engine.block_eigenvalue and the monitors",
    ),
    # --- compile: DeepCompile's knobs (DeepCompile itself is unsupported) -------------------
    *(
        Ignored(
            f"compile.{name}",
            kind,
            "a DeepCompile setting; zerodp compiles with torch.compile, not DeepCompile",
            _is(default),
            "DeepCompile is not implemented",
        )
        for name, kind, default in DEEPCOMPILE_KNOBS
    ),
)
