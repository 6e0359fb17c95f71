"""Keys of features zerodp configures its own way: `checkpoint` (loads at any world size
and stage), `eigenvalue` (reported through the monitors), and `compile`'s DeepCompile
knobs (zerodp compiles with torch.compile; DeepCompile itself is unsupported).
"""

from __future__ import annotations

from zerodp.config.compat.deepcompile import DEEPCOMPILE_KNOBS
from zerodp.config.compat.ignored.entry import Ignored, equals
from zerodp.config.compat.kinds import BOOL, STR

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
)
