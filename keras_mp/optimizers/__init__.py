"""Optimizer wrappers: the RFC 234 pipeline and RFC 293 loss scaling.

Imports from keras_mp only `optimizers.lookahead`,
`optimizers.loss_scale_optimizer`, `optimizers.wrapper`; nothing above its
floor (see ARCHITECTURE.md).
"""

from keras_mp.optimizers.lookahead import Lookahead
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_mp.optimizers.wrapper import OptimizerWrapper

__all__ = ["Lookahead", "LossScaleOptimizer", "OptimizerWrapper"]
