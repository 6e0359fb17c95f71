"""Backward: the per-graph-task lifecycle and gradient reduction (every stage).

`autograd_api` is the only user of PyTorch's private autograd APIs;
`lifecycle` gives each graph task one prologue and one epilogue;
`reducer` averages gradients over ranks into the storage the stage keeps;
`hooks` connects autograd's hooks to both.
"""

from zerodp.backward.lifecycle import BackwardLifecycle, GraphTask, TaskPhase

__all__ = ["BackwardLifecycle", "GraphTask", "TaskPhase"]
