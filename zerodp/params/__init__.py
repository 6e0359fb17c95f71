"""Stage 3: sharded parameters, gathered only while a module needs them.

`coordinator` (when to gather and release), `module_hooks` and
`saved_tensors` (what tells it), `zero_parameter` (gather on use, or a clear
error), `prefetch` (the recorded order), `runtime` (all of it wired for an
engine, and the null object for stages 0-2) and `init` (building a model
already sharded). A group's gather state itself is `zerodp.group.GatherState`.
"""
