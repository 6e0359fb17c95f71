"""The tensor-wise step: optimizers that read whole tensors, exact at every stage.

[Note: tensor-wise step]
The flat step hands the torch optimizer each rank's owned range, a 1-D
slice of a flat group: right for an update that reads each element alone
(`selection`), silently another update for one that reads a whole tensor
(Adafactor's row and column statistics see a vector) and refused by Muon
(a gradient "must be a 2D matrix"). The tensor-wise step keeps everything
else of ZeRO (reduction, shards, optimizer copies, gathers) and changes only
what the torch optimizer is handed:

1. `plan`: every tensor of a tensor-wise group gets one owner rank; the plan
   says which fragments of which tensors travel (only those of tensors that
   straddle a shard boundary, with the default placement).
2. At the accumulation boundary, after the gradients are averaged, unscaled
   and clipped by the global norm of the raw gradients (exactly as for the
   flat step: clip_grad_norm_ then step()), `exchange` sends each owner the
   gradient fragments of its tensors, and the value fragments where the
   values are not resident on every rank.
3. The owner's torch optimizer steps the whole tensor, in its own shape
   (`step.TensorwiseStep`): the same code as in one process, once per
   optimizer step, on the averaged gradient. Its state (Muon's momentum,
   Adafactor's factored moments) lives with the owner, keyed to the tensor.
4. The stepped values go back to the ranks whose owned ranges hold them;
   from there the stage carries on as after a flat step (optimizer copies
   into the model, all-gather where parameters are kept whole).

At stage 0 every rank holds every tensor and steps all of them (nothing
moves). Checkpoints save tensor-wise state by parameter name, whole, from its
owner; a load at another world size gives it to the new owner
(`zerodp.checkpoint_io.tensors`).
"""

from zerodp.optim.tensorwise.ownership import (
    ALL_RANKS,
    GroupLayout,
    OwnerPlacement,
    TensorPlan,
    TensorTask,
    build_plan,
)
from zerodp.optim.tensorwise.selection import UpdatePath, declare_elementwise, update_path
from zerodp.optim.tensorwise.step import TensorwiseStep

__all__ = [
    "ALL_RANKS",
    "GroupLayout",
    "OwnerPlacement",
    "TensorPlan",
    "TensorTask",
    "TensorwiseStep",
    "UpdatePath",
    "build_plan",
    "declare_elementwise",
    "update_path",
]
