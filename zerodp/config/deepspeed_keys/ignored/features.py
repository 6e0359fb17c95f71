"""Keys of features zerodp configures its own way: `checkpoint` (loads at any world size
and stage), `eigenvalue` (reported through the monitors), `compile`'s DeepCompile
knobs (zerodp compiles with torch.compile; DeepCompile itself is unsupported), and
`tensor_parallel`'s tuning knobs (docs/tensor-parallel.md).
"""

from __future__ import annotations

from zerodp.config.deepspeed_keys.deepcompile import DEEPCOMPILE_KNOBS
from zerodp.config.deepspeed_keys.ignored.entry import Ignored, equals
from zerodp.config.deepspeed_keys.kinds import BOOL, STR

FEATURES: tuple[Ignored, ...] = (
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
)
