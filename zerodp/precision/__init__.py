"""Mixed precision: the dtype policy, fp32 master weights, and fp16 loss scaling."""

from zerodp.precision.loss_scaler import LossScaleError, LossScaler, loss_scaler_from_config
from zerodp.precision.policy import PrecisionPolicy, precision_policy

__all__ = [
    "LossScaleError",
    "LossScaler",
    "PrecisionPolicy",
    "loss_scaler_from_config",
    "precision_policy",
]
