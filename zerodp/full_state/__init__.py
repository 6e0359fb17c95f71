"""Full views of sharded state: what a user sees of a parameter or a model whatever the stage.

- `param_managers`: which engine manages a parameter (the one map from a parameter to
  its engine, seen through the narrow `ParamManager` protocol, so that nothing here
  imports the engine); a second engine on a managed model is refused;
- `param_state`: `FullStateAccessor`, one parameter's gradient, fp32 value and optimizer
  state, whole (a collective) or this rank's part (local); behind `zerodp.utils`;
- `gathered_parameters`: `GatheredParameters`, whole parameters outside forward,
  optionally modified by one rank;
- `state_dicts`: a model's full state dict gathered, saved as safetensors in bounded
  memory, or loaded one tensor at a time; behind `zerodp.zero.*_state_dict`.

The public names are re-exported by `zerodp.zero` and `zerodp.utils` (DeepSpeed's
places for them).
"""

from zerodp.full_state.gathered_parameters import GatheredParameters
from zerodp.full_state.param_managers import ParamManager, manager_of, manager_of_module
from zerodp.full_state.param_state import FullStateAccessor
from zerodp.full_state.state_dicts import full_state_dict, load_state_dict, save_state_dict

__all__ = [
    "FullStateAccessor",
    "GatheredParameters",
    "ParamManager",
    "full_state_dict",
    "load_state_dict",
    "manager_of",
    "manager_of_module",
    "save_state_dict",
]
