"""keras_mp: complete mixed precision and customizable optimizers for Keras 3.

The package's face: it imports every floor and nothing in keras_mp imports it.

The public API of RFC 293 (Keras Mixed Precision API) and RFC 234 (Easily
Customizable Optimizer.minimize) on the TensorFlow, JAX and PyTorch backends
of Keras 3.
"""

# First: it raises ImportError under a backend keras_mp does not support.
from keras_mp import _supported_backends  # noqa: F401, I001
from keras_mp import callbacks
from keras_mp import fp8
from keras_mp import losses
from keras_mp import models
from keras_mp import optimizers
from keras_mp import transforms
from keras_mp.autocast import AutoCastVariable
from keras_mp.autocast import enable_autocast
from keras_mp.explain import explain_precision
from keras_mp.loss_scale import DynamicLossScale
from keras_mp.loss_scale import FixedLossScale
from keras_mp.loss_scale import LossScale
from keras_mp.optimizers import LossScaleOptimizer
from keras_mp.optimizers import OptimizerWrapper
from keras_mp.policy import Policy
from keras_mp.precision import DEFAULT_FLOAT32_ISLANDS
from keras_mp.precision import PrecisionRules
from keras_mp.precision import precision_rules
from keras_mp.precision.global_policy import global_policy
from keras_mp.precision.global_policy import policy_scope
from keras_mp.precision.global_policy import set_global_policy
from keras_mp.recommend import PolicyRecommendation
from keras_mp.recommend import recommend_policy

# The one source of the version: pyproject reads this literal
# ([tool.setuptools.dynamic]); keras_mp/CHANGELOG.md names it.
__version__ = "0.3.5"

__all__ = [
    "AutoCastVariable",
    "DEFAULT_FLOAT32_ISLANDS",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "LossScaleOptimizer",
    "OptimizerWrapper",
    "Policy",
    "PolicyRecommendation",
    "PrecisionRules",
    "callbacks",
    "enable_autocast",
    "explain_precision",
    "fp8",
    "global_policy",
    "losses",
    "models",
    "optimizers",
    "policy_scope",
    "precision_rules",
    "recommend_policy",
    "set_global_policy",
    "transforms",
]
