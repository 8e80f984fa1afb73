"""Gradient transforms as named plug-ins, composed in order with `Chain`.

A transform maps a list of `(gradient, variable)` pairs to a new one. It is
given to `keras_mp.OptimizerWrapper(transform_gradients=[...])` as an
instance, a registered name (`"clip_by_global_norm"`), a `(name, config)`
tuple or a plain callable; it has `get_config`/`from_config` and, when it
keeps state in Keras variables, `get_state`/`set_state`.
"""

from keras_mp.transforms.base import Transform
from keras_mp.transforms.base import register_transform
from keras_mp.transforms.chain import CallableTransform
from keras_mp.transforms.chain import Chain
from keras_mp.transforms.chain import deserialize
from keras_mp.transforms.chain import get
from keras_mp.transforms.chain import serialize
from keras_mp.transforms.clipping import AdaptiveClipByGlobalNorm
from keras_mp.transforms.clipping import ClipByGlobalNorm
from keras_mp.transforms.clipping import ClipByNorm
from keras_mp.transforms.clipping import ClipByValue
from keras_mp.transforms.noise import GaussianNoise
from keras_mp.transforms.regularization import DecoupledWeightDecay
from keras_mp.transforms.regularization import GradientCentralization
from keras_mp.transforms.sanitize import ReplaceNonFinite

__all__ = [
    "AdaptiveClipByGlobalNorm",
    "CallableTransform",
    "Chain",
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "DecoupledWeightDecay",
    "GaussianNoise",
    "GradientCentralization",
    "ReplaceNonFinite",
    "Transform",
    "deserialize",
    "get",
    "register_transform",
    "serialize",
]
