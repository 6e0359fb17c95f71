"""Keys of features zerodp configures its own way: `checkpoint` (tags are not compared;
the writer's I/O knobs are DeepSpeed's fast writer's), `eigenvalue` (reported through
the monitors), `compile`'s DeepCompile knobs (zerodp compiles with torch.compile;
DeepCompile itself is unsupported), and `tensor_parallel`'s tuning knobs
(docs/tensor-parallel.md).
"""

from __future__ import annotations

from zerodp.config.deepspeed_keys.deepcompile import DEEPCOMPILE_KNOBS
from zerodp.config.deepspeed_keys.ignored.entry import Ignored, equals
from zerodp.config.deepspeed_keys.kinds import ANY, BOOL, INT, NUMBER, STR, nullable

FEATURES: tuple[Ignored, ...] = (
    # --- checkpoint, eigenvalue -------------------------------------------------------------
    Ignored(
        "checkpoint.tag_validation",
        STR,
        "zerodp does not compare checkpoint tags across ranks",
        lambda v: isinstance(v, str) and v.lower() == "ignore",
        "zerodp does not check that ranks pass the same tag; pass the same tag on every rank",
    ),
    # DeepSpeed's fast checkpoint writer's I/O knobs (`decoupled` beside them is zerodp's too).
    *(
        Ignored(
            f"checkpoint.writer.{name}",
            kind,
            "a setting of DeepSpeed's fast checkpoint writer; zerodp writes with "
            "torch.distributed.checkpoint's file writer",
        )
        for name, kind in (
            ("io_buffer_size", NUMBER),
            ("io_buffer_double", BOOL),
            ("io_multiplier", INT),
            ("show_statistics", BOOL),
            ("data_parallel", nullable(STR)),
        )
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
            equals(default),
            "DeepCompile is not implemented",
        )
        for name, kind, default in DEEPCOMPILE_KNOBS
    ),
    # --- tensor_parallel: AutoTP's tuning knobs ----------------------------------------------
    Ignored(
        "tensor_parallel.tp_overlap_comm",
        BOOL,
        "zerodp's tensor-parallel all-reduces run in order with the compute",
        equals(False),
        "zerodp does not overlap the tensor-parallel all-reduces with compute (the results "
        "are the same)",
    ),
    Ignored(
        "tensor_parallel.keep_module_on_host",
        BOOL,
        "zerodp splits the model already in memory at initialize (nothing is loaded then)",
        equals(False),
        "zerodp splits the model where it is, then moves each rank's slices to its device",
    ),
    # --- expert_parallel: AutoEP's kernel knobs and model descriptions -------------------------
    *(
        Ignored(
            f"expert_parallel.{name}",
            kind,
            "a setting of DeepSpeed's AutoEP kernels; zerodp dispatches with its own all-to-alls",
        )
        for name, kind in (
            ("use_grouped_mm", BOOL),
            ("disable_triton_grouped_mm", BOOL),
            ("combine_impl", STR),
            ("row_weighting_impl", STR),
            ("gate_up_impl", STR),
            ("comm_backend", STR),
            ("comm_num_sm", INT),
            ("comm_qp_margin", INT),
            ("comm_max_tokens_per_rank", INT),
            ("async_split_plan", BOOL),
            ("validate_folding_routing", BOOL),
        )
    ),
    *(
        Ignored(
            f"expert_parallel.{name}",
            kind,
            "zerodp reads the experts, router and shared experts from the model itself (its "
            "expert plan), not from a description",
        )
        for name, kind in (
            ("router_pattern", STR),
            ("expert_w1", STR),
            ("expert_w2", STR),
            ("expert_w3", ANY),
            ("num_experts_attr", STR),
            ("top_k_attr", STR),
            ("has_shared_experts", ANY),
            ("shared_experts_pattern", STR),
            ("shared_experts_gate_pattern", STR),
            ("expert_activation", ANY),
        )
    ),
)
