"""DeepSpeed's older and alternative key names, rewritten to the ones zerodp validates.

DeepSpeed kept accepting renamed keys (`bfloat16`, `stage3_gather_fp16_...`,
`cpu_offload`) and its pydantic models accept both a field's name and its
`stage3_` alias, so real configs use all of them. Rewriting them first means
every later step, and every error message, sees one canonical spelling; the
original spelling is remembered so a later error can still name what the
user wrote.
"""

from __future__ import annotations

from typing import Any

from zerodp.config.deepspeed_keys.kinds import get, has, pop, put, show

# (older or alternative name, the name zerodp validates)
RENAMES: tuple[tuple[str, str], ...] = (
    ("bfloat16", "bf16"),
    (
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    (
        "zero_optimization.gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    ("zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"),
    (
        "zero_optimization.param_persistence_threshold",
        "zero_optimization.stage3_param_persistence_threshold",
    ),
    (
        "zero_optimization.model_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
    ),
    ("zero_optimization.max_live_parameters", "zero_optimization.stage3_max_live_parameters"),
    ("zero_optimization.max_reuse_distance", "zero_optimization.stage3_max_reuse_distance"),
    (
        "zero_optimization.module_granularity_threshold",
        "zero_optimization.stage3_module_granularity_threshold",
    ),
    (
        "zero_optimization.use_all_reduce_for_fetch_params",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    ),
    ("zero_optimization.allgather_sequential", "zero_optimization.stage3_allgather_sequential"),
    (
        "zero_optimization.partition_stream_chunk_size",
        "zero_optimization.stage3_partition_stream_chunk_size",
    ),
    ("optimizer.params.adamw_mode", "optimizer.params.adam_w_mode"),  # DeepSpeedCPUAdam's
    ("optimizer.params.max_grad_norm", "gradient_clipping"),  # FusedAdam's, before 0.4
    # AutoTP's pydantic fields, by name beside their aliases `tp` and `kernel_inject`.
    ("tensor_parallel.tensor_parallel", "tensor_parallel.tp"),
    ("tensor_parallel.kernel_inject", "tensor_parallel.replace_with_kernel_inject"),
)

# Flags that stand for a whole section: (older flag, the section it turns on when true).
SWITCHES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("zero_optimization.cpu_offload", "zero_optimization.offload_optimizer", {"device": "cpu"}),
    ("zero_optimization.cpu_offload_param", "zero_optimization.offload_param", {"device": "cpu"}),
    ("fp32_allreduce", "communication_data_type", {}),
)

# DeepSpeed optimizer classes users name in configs, by lower-cased name -> torch's.
OPTIMIZER_TYPES: dict[str, str] = {
    "fusedadam": "Adam",  # DeepSpeed's CUDA Adam; adam_w_mode (default true) picks AdamW
    "cpuadam": "Adam",
    "deepspeedcpuadam": "Adam",
    "cpuadagrad": "Adagrad",
    "deepspeedcpuadagrad": "Adagrad",
    "fusedlamb": "Lamb",
    "fusedlion": "Lion",
    "cpulion": "Lion",
    "deepspeedcpulion": "Lion",
}

_PIN = "zero_optimization.cpu_offload_use_pin_memory"

# Every older or alternative key path this module rewrites (for "did you mean" and the docs).
ALIAS_PATHS: tuple[str, ...] = (
    *(old for old, _ in RENAMES),
    *(flag for flag, _, _ in SWITCHES),
    _PIN,
)


def apply_aliases(data: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Rewrite `data` in place; returns (canonical path -> name written, problems)."""
    written: dict[str, str] = {}
    problems: list[str] = []
    if isinstance(data.get("zero_optimization"), bool):
        # DeepSpeed's first format: `"zero_optimization": true` meant stage 1.
        data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}
        written["zero_optimization.stage"] = "zero_optimization"
    for old, new in RENAMES:
        _rename(data, old, new, written, problems)
    for flag, section, on in SWITCHES:
        _switch(data, flag, section, on, written, problems)
    _pin_memory(data, problems)
    _optimizer_type(data, written)
    return written, problems


def _rename(
    data: dict[str, Any], old: str, new: str, written: dict[str, str], problems: list[str]
) -> None:
    if not has(data, old):
        return
    value = pop(data, old)
    if has(data, new) and get(data, new) != value:
        problems.append(
            f"config keys '{old}' (an older name) and '{new}' are both set, to "
            f"{show(value)} and {show(get(data, new))}; keep only '{new}'"
        )
        return
    put(data, new, value)
    written[new] = old


def _switch(
    data: dict[str, Any],
    flag: str,
    section: str,
    on: dict[str, Any],
    written: dict[str, str],
    problems: list[str],
) -> None:
    if not has(data, flag):
        return
    value = pop(data, flag)
    if not isinstance(value, bool):
        problems.append(f"config key '{flag}': got {show(value)}; allowed: true or false")
        return
    if not value:
        return
    if flag == "fp32_allreduce":  # DeepSpeed's older name for communication_data_type "fp32"
        if get(data, section) not in (None, "fp32"):
            problems.append(
                f"config key '{flag}' is true but '{section}' is {show(get(data, section))}; "
                f"remove '{flag}'"
            )
            return
        put(data, section, "fp32")
        written[section] = flag
        return
    current = get(data, section)
    if isinstance(current, dict) and current.get("device", "none") not in ("none", "cpu"):
        problems.append(
            f"config key '{flag}' is true but '{section}.device' is "
            f"{show(current['device'])}; remove '{flag}'"
        )
        return
    merged = {**(current if isinstance(current, dict) else {}), **on}
    put(data, section, merged)
    written[f"{section}.device"] = flag


def _pin_memory(data: dict[str, Any], problems: list[str]) -> None:
    """`cpu_offload_use_pin_memory` applied to whichever offload sections exist."""
    if not has(data, _PIN):
        return
    value = pop(data, _PIN)
    if not isinstance(value, bool):
        problems.append(f"config key '{_PIN}': got {show(value)}; allowed: true or false")
        return
    for section in ("offload_optimizer", "offload_param"):
        block = get(data, f"zero_optimization.{section}")
        if isinstance(block, dict):
            block.setdefault("pin_memory", value)


def _optimizer_type(data: dict[str, Any], written: dict[str, str]) -> None:
    kind = get(data, "optimizer.type")
    if isinstance(kind, str) and kind.lower() in OPTIMIZER_TYPES:
        put(data, "optimizer.type", OPTIMIZER_TYPES[kind.lower()])
        written["optimizer.type"] = f"optimizer.type {show(kind)}"
