"""Backward: the per-graph-task lifecycle and gradient reduction (every stage).

`autograd_api` is the only user of PyTorch's private autograd APIs;
`lifecycle` gives each graph task one prologue and one epilogue;
`reducer` averages gradients over ranks into the kept gradients;
`hooks` connects autograd's hooks to both; `step_gate` owns whether the
optimizer may step.
"""

from zerodp.backward.lifecycle import BackwardLifecycle, GraphTask

__all__ = ["BackwardLifecycle", "GraphTask"]
