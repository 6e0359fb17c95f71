"""What a checkpoint load is asked to restore, held in one record.

`engine.load_checkpoint` keeps DeepSpeed's signature; it packs the options into a
`LoadOptions`, which is handed whole to `load_any_checkpoint` and on to whichever
loader reads the folder (zerodp's own or DeepSpeed's), so the options are written
once and each loader reads the same derived answers (`with_optimizer`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadOptions:
    """DeepSpeed's `load_checkpoint` options, and zerodp's `verify_checksums`.

    tag: the checkpoint's folder under `load_dir`; None reads the `latest` file.
    load_optimizer_states: restore the optimizer's state and settings and the loss scaler.
    load_lr_scheduler_states: restore the LR scheduler.
    load_module_only: restore the weights only (no counters, scheduler, optimizer,
        random generators, data-loader position or kept gradients).
    verify_checksums: check every file against the checkpoint's checksums (zerodp's
        format; DeepSpeed's has none).
    prefer_universal: with no tag, read DeepSpeed's `latest_universal` before `latest`
        (the config's `checkpoint.load_universal`).
    """

    tag: str | None = None
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_only: bool = False
    verify_checksums: bool = True
    prefer_universal: bool = False

    @property
    def with_optimizer(self) -> bool:
        """Whether the optimizer's state is read: asked for, and not a weights-only load."""
        return self.load_optimizer_states and not self.load_module_only
