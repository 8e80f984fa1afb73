"""Sanitizing transforms: replacing non-finite gradient entries."""

from keras import ops

from keras_mp.backend import gradients as backend_gradients
from keras_mp.transforms.base import Transform
from keras_mp.transforms.base import _number
from keras_mp.transforms.base import register_transform


@register_transform("replace_non_finite")
class ReplaceNonFinite(Transform):
    """Replaces NaN and inf gradient entries with `value`.

    Useful where a few bad entries should not cost a whole step. Do not put
    it before a dynamic loss scale's finite check you rely on: the check
    would no longer see the overflow (in `LossScaleOptimizer` the check runs
    before these transforms, so it is unaffected).

    Args:
        value: Finite replacement value. Defaults to `0.0`.
        name: Defaults to `"replace_non_finite"`.

    Example:

    >>> replace = keras_mp.transforms.ReplaceNonFinite()
    >>> v = keras.Variable([0.0, 0.0, 0.0])
    >>> [(g, _)] = replace([(keras.ops.array([1.0, np.nan, -np.inf]), v)])
    >>> keras.ops.convert_to_numpy(g).tolist()
    [1.0, 0.0, 0.0]
    """

    def __init__(self, value=0.0, name=None):
        super().__init__(name=name)
        self.value = _number("value", value)

    def _replace(self, values):
        return ops.where(
            ops.isfinite(values), values, ops.full_like(values, self.value)
        )

    def call(self, grads_and_vars):
        return [
            (
                None
                if g is None
                else backend_gradients.map_gradient(self._replace, g),
                v,
            )
            for g, v in grads_and_vars
        ]

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["value"] = self.value
        return config
