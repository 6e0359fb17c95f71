"""Stage 3: sharded parameters, gathered only while a module needs them.

`sharded_group` (a group's state and its collectives), `coordinator` (when to
gather and release), `module_hooks` and `saved_tensors` (what tells it),
`zero_parameter` (gather on use, or a clear error), `prefetch` (the recorded
order), `runtime` (all of it wired for an engine), `init` (building a model
already sharded) and `gathered` (GatheredParameters).
"""

from zerodp.params.status import ParamStatus

__all__ = ["ParamStatus"]
