"""One record per flat group: everything zerodp holds for it, owned in one place.

[Note: zerodp tensors]
The words the code uses for the tensors of one flat group, defined once:

- full: the group's flat buffer, every parameter end to end, padded to a
  multiple of the world size (`FlatGroup.full`). Parameters are views of it.
- shard: this rank's equal 1/N slice of the full buffer (`FlatGroup.shard`):
  a view of the full buffer for a persistent group, a separate tensor for a
  sharded one.
- persistent: the full buffer is allocated at all times (every group at
  stages 0-2; groups of parameters below `stage3_param_persistence_threshold`
  at stage 3). Its opposite is sharded: at stage 3 the full buffer exists
  only while the group is gathered (`GatherState`).
- owned range: the part of the group this rank's optimizer steps
  (`FlatGroup.owned_range`, `FlatGroup.owned`): the whole group at stage 0,
  the shard at stages 1-3. Decided in one place, from the stage strategy.
- optimizer copy: a separate tensor holding the owned range for the
  optimizer to step (`OptimizerParam.copy`): the fp32 master under mixed
  precision. Without one, the optimizer steps the model's owned range in place.
- optimizer parameter: the `nn.Parameter` the torch optimizer holds for the
  group (`OptimizerParam.param`): an alias of the optimizer copy, or of the
  owned range.
- kept gradient: the gradient zerodp keeps for a trainable group between a
  backward and the step (`KeptGradient.storage`): the full group at stages
  0-1, the shard at stages 2-3. Its `GradSync` says whether it is still this
  rank's local sum or averaged over ranks. At stages 1-3 a zero kept gradient
  holds no memory until its group's next reduction (`KeptGradient.zero`).
- bucket: a reusable full-size buffer one graph task's contribution is
  collected in before it is reduced into the kept gradient.
- secondary shard: hpZ's cached copy of a sharded group's H-th inside a
  smaller group (`SecondaryShard`, see [Note: hpZ secondary shard]).

With shard groups (see [Note: shard groups] in `zerodp.comm.topology`) "the
world size" above is the shard group's size and "this rank's shard" the one at
its place in its shard group.

`GroupState` holds a group's `FlatGroup`, its `KeptGradient` and
`OptimizerParam` (trainable groups) and its `GatherState` (sharded groups);
`GroupIndex`, owned by the engine, is the one map from a parameter to its
group. Behaviour stays with its concern: `zerodp.backward` reduces into the
kept gradients, `zerodp.stage3` decides when sharded groups are gathered,
`zerodp.optim` steps the optimizer parameters.
"""

from zerodp.group_state.gather import GatherState, ParamStatus
from zerodp.group_state.kept_gradient import GradSync, KeptGradient, TaskContribution
from zerodp.group_state.optimizer_param import HostBuffers, OptimizerParam
from zerodp.group_state.secondary import SecondaryShard
from zerodp.group_state.state import GroupIndex, GroupState

__all__ = [
    "GatherState",
    "GradSync",
    "GroupIndex",
    "GroupState",
    "HostBuffers",
    "KeptGradient",
    "OptimizerParam",
    "ParamStatus",
    "SecondaryShard",
    "TaskContribution",
]
