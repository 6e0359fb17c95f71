"""What a DeepSpeed training script calls besides the training loop, for zerodp.

A DeepSpeed script runs on zerodp with its imports changed (`import zerodp as
deepspeed`). The training surface is zerodp's own (`initialize`, the engine);
this package holds the rest a script touches: DeepSpeed's command-line flags
(`arguments`: `add_config_arguments`, the config read from `args`), DeepSpeed's
module paths that zerodp serves (`modules`: `zerodp.runtime.lr_schedules`, ...;
installed when zerodp is imported), and one message for each DeepSpeed feature
zerodp does not implement (`unsupported`). docs/deepspeed.md ("Coming from
DeepSpeed") is the user's view of it.

A face over the package: nothing in zerodp but its top-level `__init__` imports it.
"""

from __future__ import annotations

from zerodp.compat import modules
from zerodp.compat.arguments import add_config_arguments

__all__ = ["add_config_arguments"]

modules.install()
