"""Expert parallelism: each rank of an EP group holds E-th of every MoE layer's experts.

- `plan`: which modules of a model are its experts modules and which of their
  tensors are experts-first (a Hugging Face MoE model's own `base_model_ep_plan`,
  or `expert_parallel.plan`);
- `split`: the checks and the split itself (`split_experts`);
- `record`: `ExpertSplit`, the record of which experts a rank holds, and whole
  tensors gathered back from the slices (`whole_value`);
- `layers`: the class a split experts module takes, whose forward dispatches;
- `dispatch`: that forward, tokens to their experts' ranks and back
  ([Note: expert-parallel dispatch]);
- `routing`: the router's choice as assignments ordered by expert;
- `all_to_all`: the counts and rows exchanged, with autograd, on zerodp's `Comm`;
- `expert_group`: `ExpertGroup`, the group a split module works in.

Which ranks form an EP group, and what an expert gradient is divided by, are
`zerodp.parallel.ParallelDims`' rules; see docs/expert-parallel.md.
"""

from zerodp.expert_parallel.all_to_all import Route, exchange_counts, exchange_rows
from zerodp.expert_parallel.dispatch import dispatch_experts
from zerodp.expert_parallel.expert_group import ExpertGroup
from zerodp.expert_parallel.layers import ExpertParallelExperts, expert_parallel_class
from zerodp.expert_parallel.plan import (
    EXPERT_COUNT_ATTRIBUTES,
    ExpertPlan,
    ExpertsModule,
    PlanSource,
    find_experts,
    huggingface_ep_plan,
    read_plan,
)
from zerodp.expert_parallel.record import ExpertSlice, ExpertSplit, ExpertTensor
from zerodp.expert_parallel.split import split_experts

__all__ = [
    "EXPERT_COUNT_ATTRIBUTES",
    "ExpertGroup",
    "ExpertParallelExperts",
    "ExpertPlan",
    "ExpertSlice",
    "ExpertSplit",
    "ExpertTensor",
    "ExpertsModule",
    "PlanSource",
    "Route",
    "dispatch_experts",
    "exchange_counts",
    "exchange_rows",
    "expert_parallel_class",
    "find_experts",
    "huggingface_ep_plan",
    "read_plan",
    "split_experts",
]
