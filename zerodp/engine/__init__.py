"""The engine users hold (`ZeroEngine`) and the parts that build and serve it.

`facade` is the training loop's surface (forward, backward, step, counters);
`assembly` builds every part in dependency order; the mixins add DeepSpeed's other
methods (`deepspeed_methods`), checkpoints (`checkpointing`) and uneven inputs
(`join`); `startup_checks` makes the ranks agree before the first collective, and
`guards` refuses models and optimizers changed behind the engine's back.
"""

from zerodp.engine.facade import ZeroEngine

__all__ = ["ZeroEngine"]
