"""DeepCompile's settings in DeepSpeed's `compile` block, with DeepSpeed's defaults.

zerodp compiles with torch.compile, not DeepCompile, so these are accepted and
dropped (`zerodp.config.deepspeed_keys.ignored`); a value other than the default asks
for DeepCompile's behaviour and is warned about.
"""

from __future__ import annotations

from typing import Any

from zerodp.config.deepspeed_keys.kinds import BOOL, INT, LIST, Kind, nullable

DEEPCOMPILE_KNOBS: tuple[tuple[str, Kind, Any], ...] = (
    ("autoep_non_moe", BOOL, False),
    ("free_activation", BOOL, False),
    ("free_activation_threshold", INT, 10 * 1024 * 1024),
    ("offload_activation", BOOL, False),
    ("offload_activation_pin_memory", BOOL, True),
    ("offload_opt_states", BOOL, False),
    ("double_buffer", BOOL, True),
    ("symmetric_memory", BOOL, False),
    ("debug_log", BOOL, False),
    ("offload_parameters", BOOL, False),
    ("sync_before_reduce", BOOL, False),
    ("sync_after_reduce", BOOL, False),
    ("sync_before_allgather", BOOL, False),
    ("sync_after_allgather", BOOL, False),
    ("keep_int_input_tensors", BOOL, True),
    ("keep_all_input_tensors", BOOL, False),
    ("passes", nullable(LIST), None),
)
