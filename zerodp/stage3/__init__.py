"""Stage 3: sharded parameters, gathered only while a module needs them.

`coordinator` (when to gather and release), `gatherer` (gathers issued,
waited for, released and held; what is live), `forward_scopes` (the forward
scopes running now and what they claim), `module_groups` (which groups each
module gathers), `module_hooks` and `saved_tensors` (what tells them),
`zero_parameter` (gather on use, or a clear error), `prefetch` (the recorded
order), `runtime` (all of it wired for an engine, and the null object for
stages 0-2) and `init` (building a model already sharded). A group's
gather state itself is `zerodp.group_state.GatherState`.
"""
