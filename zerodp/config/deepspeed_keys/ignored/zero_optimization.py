"""`zero_optimization` keys without effect in zerodp: choices it always makes one way
(reduce-scatter, contiguous buffers, one all-gather per flat group), stage 3 tunings it
has no counterpart for, and the tunings of DeepSpeed's offload and its libaio settings
(`aio`).
"""

from __future__ import annotations

from zerodp.config.deepspeed_keys.ignored.entry import Ignored, equals
from zerodp.config.deepspeed_keys.kinds import BOOL, INT, NUMBER, block

NO_OFFLOAD = "a tuning of DeepSpeed's CPU offload; zerodp's offload needs none"

ZERO_OPTIMIZATION: tuple[Ignored, ...] = (
    # --- zero_optimization ---------------------------------------------------------------
    Ignored(
        "zero_optimization.allgather_partitions",
        BOOL,
        "zerodp all-gathers the updated shards after each step",
        equals(True),
        "zerodp has no broadcast-based parameter update; it all-gathers",
    ),
    Ignored(
        "zero_optimization.mics_hierarchical_params_gather",
        BOOL,
        "a shard group gathers with one all-gather (its backend follows the topology)",
        equals(False),
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
        equals(True),
        "zerodp has no all-reduce variant of stages 1-3",
    ),
    Ignored(
        "zero_optimization.contiguous_gradients",
        BOOL,
        "zerodp always reduces gradients through contiguous flat buffers",
        equals(True),
        "zerodp cannot turn contiguous gradient buffers off",
    ),
    Ignored(
        "zero_optimization.compute_grad_norm",
        BOOL,
        "zerodp computes the global gradient norm at every step",
        equals(True),
        "zerodp always computes it (for clipping and get_global_grad_norm())",
    ),
    Ignored(
        "zero_optimization.load_from_fp32_weights",
        BOOL,
        "zerodp checkpoints hold the fp32 master weights, and loading restores them",
        equals(True),
        "zerodp always restores the fp32 masters from the checkpoint",
    ),
    Ignored(
        "zero_optimization.grad_hooks",
        BOOL,
        "zerodp always reduces from gradient hooks during backward",
        equals(True),
        "zerodp cannot defer stage-1 reduction hooks",
    ),
    Ignored("zero_optimization.round_robin_gradients", BOOL, NO_OFFLOAD),
    *(
        Ignored(f"zero_optimization.offload_optimizer.{key}", kind, NO_OFFLOAD)
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
        Ignored(f"zero_optimization.offload_param.{key}", INT, NO_OFFLOAD)
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
        equals(False),
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
        equals(False),
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
        equals(False),
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
        equals(True),
        "zerodp never raises for unused parameters",
    ),
    Ignored(
        "zero_optimization.legacy_stage1",
        BOOL,
        "zerodp has one stage 1 implementation",
        equals(False),
        "zerodp has no legacy stage 1",
    ),
)
