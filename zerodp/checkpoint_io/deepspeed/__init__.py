"""DeepSpeed ZeRO checkpoints, read into a zerodp engine at any stage and world size.

A user moving a run from DeepSpeed calls `engine.load_checkpoint(ds_dir)` as
before; the folder's format is recognised (`files`), its pickles are read
without running code from them (`unpickle`), DeepSpeed's dicts become typed
records (`records`), flat partitions map to named element ranges
(`layout`), and each rank reads only what it owns (`sources`) into the
places `destinations` planned; counters, scheduler, loss scaler and optimizer
settings are translated in `training_state`, and `load` runs it all with
zerodp's check-then-change discipline. `convert` writes a zerodp checkpoint
or sharded safetensors from one. What is read from which DeepSpeed file is
tabled in docs/deepspeed.md.
"""

from zerodp.checkpoint_io.deepspeed.files import DeepSpeedFiles, DeepSpeedFormat, find_checkpoint
from zerodp.checkpoint_io.deepspeed.load import load_deepspeed_checkpoint

__all__ = ["DeepSpeedFiles", "DeepSpeedFormat", "find_checkpoint", "load_deepspeed_checkpoint"]
