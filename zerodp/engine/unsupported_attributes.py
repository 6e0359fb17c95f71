"""DeepSpeed engine attributes zerodp does not have, each with what to use instead.

`engine.<name>` for a name here raises `zerodp.UnsupportedFeatureError` (an
`AttributeError`, so `hasattr` stays False) with the message; any other
missing name is an ordinary AttributeError. docs/deepspeed.md lists them.
"""

from __future__ import annotations

_FLOPS = "zerodp has no flops profiler; use torch.profiler or torch.utils.flop_counter"
_TIMERS = (
    "zerodp has no wall-clock timers; use torch.profiler, or bench/step_time.py for step "
    "time against DDP"
)
_BATCH = (
    "zerodp fixes the batch sizes at initialize (train_batch_size, "
    "train_micro_batch_size_per_gpu, gradient_accumulation_steps); restart from a "
    "checkpoint with the new values"
)
_DATA = (
    "DeepSpeed's data-efficiency library (curriculum learning, data sampling, random-LTD) is "
    "not in zerodp; order and filter the data in your own Dataset or DataLoader"
)
_PIPE = (
    "pipeline parallelism is not in zerodp (it is data parallel only); train the whole "
    "model on every rank with zero_optimization.stage 3, which shards its parameters"
)
_MOE = (
    "DeepSpeed's MoE layers are not in zerodp; build the experts as ordinary modules and "
    "mark the MoE block with zerodp.zero.set_z3_leaf_modules"
)
_PLACEMENT = (
    "the engine's device and dtype are fixed at initialize: choose the precision with the "
    "config's bf16 / fp16 blocks and the device with ZERODP_DEVICE"
)
_PARALLEL = (
    "zerodp's tensor and sequence parallelism are set in the config "
    '("tensor_parallel": {"autotp_size": T}, "sequence_parallel_size": S) and keep their '
    "groups inside the engine (docs/tensor-parallel.md, docs/sequence-parallel.md); it has "
    "no Megatron-style mpu or parallel-group getters"
)

UNSUPPORTED_ENGINE_ATTRIBUTES: dict[str, str] = {
    "flops_profiler": _FLOPS,
    "flops_profiler_enabled": _FLOPS,
    "timers": _TIMERS,
    "tput_timer": _TIMERS,
    "get_wall_clock_timers": _TIMERS,
    "wall_clock_breakdown": _TIMERS,
    "print_forward_breakdown": _TIMERS,
    "set_train_batch_size": _BATCH,
    "set_train_micro_batch_size": _BATCH,
    "curriculum_learning_enabled": _DATA,
    "set_custom_curriculum_learning_schedule": _DATA,
    "data_efficiency_enabled": _DATA,
    "set_data_post_process_func": _DATA,
    "random_ltd_enabled": _DATA,
    "random_ltd_initialize": _DATA,
    "get_pld_theta": "progressive layer drop is not in zerodp; drop layers in your model",
    "progressive_layer_drop": "progressive layer drop is not in zerodp; drop layers in your model",
    "train_batch": _PIPE,
    "eval_batch": _PIPE,
    "set_batch_fn": _PIPE,
    "is_first_stage": _PIPE,
    "is_last_stage": _PIPE,
    "num_stages": _PIPE,
    "stage_id": _PIPE,
    "load_moe_state_dict": _MOE,
    "num_experts": _MOE,
    "gate_modules": _MOE,
    "moe_layers": _MOE,
    "half": _PLACEMENT,
    "bfloat16": _PLACEMENT,
    "float": _PLACEMENT,
    "to": _PLACEMENT,
    "cuda": _PLACEMENT,
    "get_sequence_parallel_group": _PARALLEL,
    "autotp_size": _PARALLEL,
    "tensor_parallel_config": _PARALLEL,
    "mpu": _PARALLEL,
    "set_autotp_mode": _PARALLEL,
    "get_type": "DeepSpeed's param-group 'type' entry has no zerodp counterpart; see get_mom()",
    "dump_state": "zerodp prints no engine state dump; print(engine.config) shows the config",
}
