"""Sharded, atomic, reshardable checkpoints on torch.distributed.checkpoint (DCP).

`save_load` saves and loads a `CheckpointSubject` (the engine's state, handed
over as narrow pieces; see `subject`); `writers` is how an engine saves:
synchronously, or decoupled from training (`host_staging`, `background_save`,
`write_reports`; both start from `save_request`); `tensors` says which tensor goes under
which key (layout-independent: one 1-D tensor per parameter); `sharded` wraps
ShardedTensor; `json_state` and `jsonable` are the JSON part; `paths`
validates and commits atomically; `integrity` checks a checkpoint before
loading; `consolidate` writes one full state dict; `safetensors_stream`
writes safetensors files one tensor at a time (full state dicts, the
DeepSpeed export). `deepspeed/` reads DeepSpeed's ZeRO checkpoints;
`any_format.load_any_checkpoint` loads whichever format a directory holds
and returns a `report.LoadReport` of what it restored.
"""

from zerodp.checkpoint_io.any_format import load_any_checkpoint
from zerodp.checkpoint_io.load_options import LoadOptions
from zerodp.checkpoint_io.report import LoadReport
from zerodp.checkpoint_io.save_load import load_checkpoint, save_checkpoint
from zerodp.checkpoint_io.subject import CheckpointSubject

__all__ = [
    "CheckpointSubject",
    "LoadOptions",
    "LoadReport",
    "load_any_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
