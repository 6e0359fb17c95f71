"""The optimizer side: the stage strategy, the sharded optimizer, norms, schedulers."""

from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import StageStrategy, strategy_for

__all__ = ["StageStrategy", "ZeroOptimizer", "strategy_for"]
