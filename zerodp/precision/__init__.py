"""Mixed precision: the dtype policy, fp16 loss scaling, and casting the model's inputs.

The fp32 master weights are each group's optimizer copy (`zerodp.group_state.OptimizerParam`).
"""

from zerodp.precision.loss_scaler import LossScaler, loss_scaler_from_config
from zerodp.precision.policy import PrecisionPolicy, precision_policy

__all__ = [
    "LossScaler",
    "PrecisionPolicy",
    "loss_scaler_from_config",
    "precision_policy",
]
