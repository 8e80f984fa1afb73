"""Optimizer wrappers: the RFC 234 pipeline and RFC 293 loss scaling."""

from keras_mp.optimizers.lookahead import Lookahead
from keras_mp.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras_mp.optimizers.wrapper import OptimizerWrapper

__all__ = ["Lookahead", "LossScaleOptimizer", "OptimizerWrapper"]
