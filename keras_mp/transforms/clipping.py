"""Gradient clipping transforms: by value, by norm, by global norm."""

import keras
from keras import ops

from keras_mp.backend import gradients as backend_gradients
from keras_mp.transforms.base import Transform
from keras_mp.transforms.base import _number
from keras_mp.transforms.base import register_transform


def _positive(name, value):
    value = _number(name, value)
    if value <= 0:
        raise ValueError(
            f"`{name}` must be positive. Received: {name}={value!r}"
        )
    return value


def _scale_all(grads_and_vars, scale):
    """Multiplies every gradient by the scalar `scale`, cast to its dtype."""
    return [
        (
            None
            if g is None
            else backend_gradients.map_gradient(
                lambda x: x * ops.cast(scale, x.dtype), g
            ),
            v,
        )
        for g, v in grads_and_vars
    ]


def _global_norm(grads):
    """The L2 norm of all non-None gradients together, as one scalar.

    Computed as `tf.linalg.global_norm` and Keras's `global_clipnorm` do
    (a sparse gradient counts its values), in float32 at least: a float16
    gradient's sum of squares overflows long before its norm does.
    """
    values = [
        backend_gradients.gradient_values(g) for g in grads if g is not None
    ]
    dtype = keras.backend.result_type(
        *[keras.backend.standardize_dtype(v.dtype) for v in values], "float32"
    )
    squared = [ops.sum(ops.square(ops.cast(v, dtype))) for v in values]
    return ops.sqrt(ops.sum(ops.stack(squared)))


@register_transform("clip_by_value")
class ClipByValue(Transform):
    """Clips every gradient element to `[-clip_value, clip_value]`.

    Keras's `clipvalue` optimizer argument as a transform. NaN elements stay
    NaN, so a finite check downstream still sees them.

    Args:
        clip_value: Positive bound.
        name: Defaults to `"clip_by_value"`.

    Example:

    >>> clip = keras_mp.transforms.ClipByValue(0.5)
    >>> v = keras.Variable([0.0, 0.0])
    >>> [(g, _)] = clip([(keras.ops.array([-2.0, 0.25]), v)])
    >>> keras.ops.convert_to_numpy(g).tolist()
    [-0.5, 0.25]
    """

    def __init__(self, clip_value, name=None):
        super().__init__(name=name)
        self.clip_value = _positive("clip_value", clip_value)

    def call(self, grads_and_vars):
        bound = self.clip_value
        return [
            (
                None
                if g is None
                else backend_gradients.map_gradient(
                    lambda x: ops.clip(x, -bound, bound), g
                ),
                v,
            )
            for g, v in grads_and_vars
        ]

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["clip_value"] = self.clip_value
        return config


@register_transform("clip_by_norm")
class ClipByNorm(Transform):
    """Rescales each gradient separately so its L2 norm is at most `clip_norm`.

    Keras's `clipnorm` optimizer argument as a transform (the same math,
    including its handling of an all-zero gradient).

    Args:
        clip_norm: Positive maximum norm of each gradient.
        name: Defaults to `"clip_by_norm"`.

    Example:

    >>> clip = keras_mp.transforms.ClipByNorm(1.0)
    >>> v = keras.Variable([0.0, 0.0])
    >>> [(g, _)] = clip([(keras.ops.array([3.0, 4.0]), v)])
    >>> [round(x, 4) for x in keras.ops.convert_to_numpy(g).tolist()]
    [0.6, 0.8]
    """

    def __init__(self, clip_norm, name=None):
        super().__init__(name=name)
        self.clip_norm = _positive("clip_norm", clip_norm)

    def _clip(self, values):
        squared = ops.sum(ops.square(values))
        # Two-sided where: the sqrt of an all-zero gradient is never taken,
        # so no NaN can leak from it (Keras's `_clip_by_norm`).
        positive = squared > 0
        safe = ops.where(positive, squared, ops.ones_like(squared))
        norm = ops.where(positive, ops.sqrt(safe), squared)
        return values * self.clip_norm / ops.maximum(norm, self.clip_norm)

    def call(self, grads_and_vars):
        return [
            (
                None
                if g is None
                else backend_gradients.map_gradient(self._clip, g),
                v,
            )
            for g, v in grads_and_vars
        ]

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["clip_norm"] = self.clip_norm
        return config


@register_transform("clip_by_global_norm")
class ClipByGlobalNorm(Transform):
    """Rescales all gradients together to a global norm of at most `max_norm`.

    Keras's `global_clipnorm` and `tf.clip_by_global_norm` as a transform,
    with the same math. When the global norm is inf or NaN, every gradient
    becomes NaN, as with `tf.clip_by_global_norm`: scaling by a non-finite
    norm would otherwise turn an overflow into finite garbage (all zeros)
    that a loss scale's finite check could no longer see. The norm is
    computed in float32 (or wider), so float16 gradients do not overflow it.

    Args:
        max_norm: Positive maximum global norm. Defaults to `1.0`.
        name: Defaults to `"clip_by_global_norm"`.

    Example:

    >>> clip = keras_mp.transforms.ClipByGlobalNorm(max_norm=1.0)
    >>> a, b = keras.Variable([0.0]), keras.Variable([0.0])
    >>> out = clip([(keras.ops.array([3.0]), a), (keras.ops.array([4.0]), b)])
    >>> [round(float(g[0]), 4) for g, _ in out]
    [0.6, 0.8]
    """

    def __init__(self, max_norm=1.0, name=None):
        super().__init__(name=name)
        self.max_norm = _positive("max_norm", max_norm)

    def call(self, grads_and_vars):
        if all(g is None for g, _ in grads_and_vars):
            return grads_and_vars
        norm = _global_norm([g for g, _ in grads_and_vars])
        scale = self.max_norm * ops.minimum(1.0 / norm, 1.0 / self.max_norm)
        # A no-op for a finite norm; NaN for inf or NaN (see the docstring).
        scale = scale + (norm - norm)
        return _scale_all(grads_and_vars, scale)

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["max_norm"] = self.max_norm
        return config


@register_transform("adaptive_clip_by_global_norm")
class AdaptiveClipByGlobalNorm(Transform):
    """Clips the global norm to a multiple of its running average.

    A fixed `max_norm` must be tuned to the model and changes meaning as
    training goes on; this transform keeps an exponential moving average of
    the (clipped) global gradient norm and clips each step's gradients to
    `multiplier` times the average of the steps before, so rare spikes are
    cut while the usual scale passes through. The first step, with no
    history yet, passes through and starts the average. A non-finite norm
    makes every gradient NaN (as `ClipByGlobalNorm` does) and leaves the
    average unchanged.

    State: `norm_average`, a float32 scalar variable (0 until the first step
    with a nonzero norm).

    Args:
        multiplier: Positive factor of the average giving the clip
            threshold. Defaults to `2.0`.
        decay: Decay of the moving average, in `[0, 1)`. Defaults to `0.99`.
        name: Defaults to `"adaptive_clip_by_global_norm"`.

    Example:

    >>> clip = keras_mp.transforms.AdaptiveClipByGlobalNorm(multiplier=2.0)
    >>> v = keras.Variable([0.0, 0.0])
    >>> _ = clip([(keras.ops.array([3.0, 4.0]), v)])
    >>> float(clip.norm_average.value)
    5.0
    >>> [(g, _)] = clip([(keras.ops.array([30.0, 40.0]), v)])
    >>> [round(x, 4) for x in keras.ops.convert_to_numpy(g).tolist()]
    [6.0, 8.0]
    """

    def __init__(self, multiplier=2.0, decay=0.99, name=None):
        super().__init__(name=name)
        self.multiplier = _positive("multiplier", multiplier)
        self.decay = _number("decay", decay)
        if not 0 <= self.decay < 1:
            raise ValueError(
                f"`decay` must be in [0, 1). Received: decay={decay!r}"
            )
        self.norm_average = None

    def build(self, var_list):
        self.norm_average = self.add_variable((), name="norm_average")

    def call(self, grads_and_vars):
        if all(g is None for g, _ in grads_and_vars):
            return grads_and_vars
        norm = ops.cast(_global_norm([g for g, _ in grads_and_vars]), "float32")
        average = ops.convert_to_tensor(self.norm_average)
        has_history = average > 0
        threshold = ops.where(has_history, self.multiplier * average, norm)
        scale = ops.where(
            norm > threshold, threshold / norm, ops.ones_like(norm)
        )
        scale = scale + (norm - norm)
        clipped_norm = ops.minimum(norm, threshold)
        updated = ops.where(
            has_history,
            self.decay * average + (1.0 - self.decay) * clipped_norm,
            norm,
        )
        self.norm_average.assign(
            ops.where(ops.isfinite(norm), updated, average)
        )
        return _scale_all(grads_and_vars, scale)

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["multiplier"] = self.multiplier
        config["decay"] = self.decay
        return config
