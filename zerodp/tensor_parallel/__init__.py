"""Tensor parallelism: each Linear a plan names split across T ranks, composed with ZeRO.

- `plan`: which modules a model splits and how (the model's own Hugging Face
  plan, or `tensor_parallel.plan`);
- `split`: the checks and the split itself, and `TensorSplit`, the record of
  which parameters are slices along which dimension;
- `layers`: the parallel classes a split module takes (column-parallel,
  row-parallel Linear, vocabulary-parallel Embedding);
- `communication`: their collectives as autograd functions on zerodp's `Comm`
  ([Note: tensor-parallel communication]);
- `checks`: the same batch on a tensor group's ranks, and the whole
  parameters bitwise equal across it;
- `setup`: the split as the engine runs it (the model taken from rank 0
  first) and `TensorParallelism`, the parts the engine keeps.

The rules that depend on the parallel dimensions (which ranks share a batch,
which groups a norm sums over, which ranks hold the same values) are
`zerodp.parallel.ParallelDims`'; see docs/tensor-parallel.md.
"""

from zerodp.tensor_parallel.checks import ReplicaCheck, SameBatchCheck, checksum
from zerodp.tensor_parallel.communication import (
    TensorGroup,
    copy_to_group,
    gather_from_group,
    gather_whole,
    reduce_from_group,
    split_to_group,
)
from zerodp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerodp.tensor_parallel.plan import Plan, PlanSource, Style, matches, read_plan
from zerodp.tensor_parallel.setup import TensorParallelism, split_for_engine
from zerodp.tensor_parallel.split import SplitParam, SplitPlan, TensorSplit, plan_split

__all__ = [
    "ColumnParallelLinear",
    "Plan",
    "PlanSource",
    "ReplicaCheck",
    "RowParallelLinear",
    "SameBatchCheck",
    "SplitParam",
    "SplitPlan",
    "Style",
    "TensorGroup",
    "TensorParallelism",
    "TensorSplit",
    "VocabParallelEmbedding",
    "checksum",
    "copy_to_group",
    "gather_from_group",
    "gather_whole",
    "matches",
    "plan_split",
    "read_plan",
    "reduce_from_group",
    "split_for_engine",
    "split_to_group",
]
