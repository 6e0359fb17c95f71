"""Sharded, atomic, reshardable checkpoints on torch.distributed.checkpoint (DCP).

`engine_io` saves and loads an engine; `tensors` says which tensor goes under
which key (layout-independent: one 1-D tensor per parameter); `plain` is the
JSON part; `paths` validates and commits atomically; `integrity` checks a
checkpoint before loading; `consolidate` writes one full state dict.
"""

from zerodp.checkpoint.engine_io import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
