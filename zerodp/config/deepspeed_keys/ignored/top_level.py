"""Top-level DeepSpeed keys without effect in zerodp: timers and profilers, gradient
scaling, collective logging, `deepspeed.checkpointing`, the accumulation dtype.
"""

from __future__ import annotations

from zerodp.config.deepspeed_keys.ignored.entry import Ignored, all_false, equals, not_enabled
from zerodp.config.deepspeed_keys.kinds import ANY, BOOL, INT, LIST, NUMBER, STR, block, nullable

TORCH_PROFILER = "use torch.profiler"

TOP_LEVEL: tuple[Ignored, ...] = (
    Ignored(
        "wall_clock_breakdown",
        BOOL,
        "zerodp has no phase timers",
        equals(False),
        f"zerodp does not time forward/backward/step; {TORCH_PROFILER}",
    ),
    Ignored(
        "dump_state",
        BOOL,
        "zerodp prints no engine state at start-up",
        equals(False),
        "zerodp does not print its state; print(engine.config) shows the resolved config",
    ),
    Ignored(
        "memory_breakdown",
        BOOL,
        "zerodp logs no per-step memory breakdown",
        equals(False),
        "zerodp does not log memory; use torch.cuda.memory_summary()",
    ),
    Ignored(
        "prescale_gradients",
        BOOL,
        "zerodp divides the reduced gradient sum by the world size",
        equals(False),
        "zerodp does not scale gradients before the reduction; it divides the sum after it",
    ),
    Ignored(
        "gradient_predivide_factor",
        NUMBER,
        "zerodp divides the reduced gradient sum by the world size, once",
        equals(1.0),
        "zerodp does not predivide; if fp16 sums overflow, use bf16 or "
        'communication_data_type "fp32"',
    ),
    Ignored(
        "sparse_gradients",
        BOOL,
        "zerodp reduces embedding gradients dense",
        equals(False),
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
        equals(True),
        "zerodp has no client-managed accumulation: call engine.step() after every micro-batch",
    ),
    Ignored(
        "disable_python_gc",
        BOOL,
        "zerodp leaves Python's garbage collector alone",
        equals(False),
        "zerodp does not disable the garbage collector; call gc.disable() yourself",
    ),
    Ignored(
        "graph_harvesting",
        BOOL,
        "zerodp captures no CUDA graphs",
        equals(False),
        "zerodp does not capture the optimizer step in a CUDA graph",
    ),
    Ignored(
        "vocabulary_size",
        INT,
        "DeepSpeed only uses it for a Tensor Core alignment warning",
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
        not_enabled,
        "zerodp does not profile FLOPs; use torch.profiler.profile(with_flops=True) or "
        "torch.utils.flop_counter.FlopCounterMode",
    ),
    Ignored(
        "comms_logger",
        block(enabled=BOOL, verbose=BOOL, prof_all=BOOL, debug=BOOL, prof_ops=LIST),
        "zerodp has no collective logger",
        not_enabled,
        f"zerodp does not log collectives; {TORCH_PROFILER} (it records them)",
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
        all_false,
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
)
