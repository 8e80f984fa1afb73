"""Regularizing transforms: gradient centralization, decoupled weight decay."""

from keras import ops

from keras_mp.transforms.base import Transform
from keras_mp.transforms.base import _number
from keras_mp.transforms.base import register_transform


@register_transform("gradient_centralization")
class GradientCentralization(Transform):
    """Centers gradients of rank > 1 on their mean over all but the last axis.

    Gradient centralization (Yong et al., 2020) constrains each output unit's
    weight gradient (the last axis of a Keras kernel) to zero mean, which
    smooths the loss landscape for dense and convolution kernels. Gradients
    of rank 0 or 1 (biases, scales) pass through unchanged. A sparse gradient
    is made dense first.

    Args:
        name: Defaults to `"gradient_centralization"`.

    Example:

    >>> center = keras_mp.transforms.GradientCentralization()
    >>> v = keras.Variable(np.zeros((2, 2), "float32"))
    >>> [(g, _)] = center([(keras.ops.array([[1.0, 2.0], [3.0, 6.0]]), v)])
    >>> keras.ops.convert_to_numpy(g).tolist()
    [[-1.0, -2.0], [1.0, 2.0]]
    """

    def call(self, grads_and_vars):
        result = []
        for g, v in grads_and_vars:
            if g is not None and len(g.shape) > 1:
                g = ops.convert_to_tensor(g)
                axes = tuple(range(len(g.shape) - 1))
                g = g - ops.mean(g, axis=axes, keepdims=True)
            result.append((g, v))
        return result


@register_transform("decoupled_weight_decay")
class DecoupledWeightDecay(Transform):
    """Decays variables towards zero, decoupled from the gradients (AdamW).

    The same update as a Keras optimizer's `weight_decay` argument:
    `variable - variable * weight_decay * learning_rate`, with the learning
    rate of the optimizer running the transform (`self.optimizer`; a
    schedule is read at the current step). It runs before the optimizer's
    update, where Keras applies its own weight decay, and only on applied
    steps. Gradients pass through unchanged. Variables whose gradient is
    None are not decayed (Keras filters them out of the update too), nor
    are variables that Keras overwrites with their gradient (float8 scales).

    Args:
        weight_decay: Non-negative decay rate, multiplied by the learning
            rate.
        exclude_from_weight_decay: List of strings; a variable whose name
            contains any of them is not decayed (e.g. `["bias", "gamma"]`).
            Defaults to `None`.
        name: Defaults to `"decoupled_weight_decay"`.

    Example:

    >>> decay = keras_mp.transforms.DecoupledWeightDecay(0.25)
    >>> decay.optimizer = keras.optimizers.SGD(learning_rate=0.5)
    >>> v = keras.Variable([4.0])
    >>> _ = decay([(keras.ops.array([1.0]), v)])
    >>> keras.ops.convert_to_numpy(v.value).tolist()
    [3.5]
    """

    def __init__(self, weight_decay, exclude_from_weight_decay=None, name=None):
        super().__init__(name=name)
        self.weight_decay = _number("weight_decay", weight_decay)
        if self.weight_decay < 0:
            raise ValueError(
                "`weight_decay` must be non-negative. Received: "
                f"weight_decay={weight_decay!r}"
            )
        if exclude_from_weight_decay is not None:
            if isinstance(exclude_from_weight_decay, str) or not all(
                isinstance(s, str) for s in exclude_from_weight_decay
            ):
                raise TypeError(
                    "`exclude_from_weight_decay` must be a list of strings "
                    "(parts of variable names). Received: "
                    f"exclude_from_weight_decay={exclude_from_weight_decay!r}"
                )
            exclude_from_weight_decay = list(exclude_from_weight_decay)
        self.exclude_from_weight_decay = exclude_from_weight_decay

    def _decays(self, variable):
        if getattr(variable, "overwrite_with_gradient", False):
            return False
        return not any(
            part in variable.name
            for part in self.exclude_from_weight_decay or ()
        )

    def call(self, grads_and_vars):
        if self.optimizer is None:
            raise ValueError(
                f"Transform {self.name!r} decays by the optimizer's learning "
                "rate, but no optimizer runs it. Received: optimizer=None. "
                "Pass it to keras_mp.OptimizerWrapper(..., "
                "transform_gradients=[...]), which sets `transform.optimizer`, "
                "or set `transform.optimizer = optimizer` before calling it."
            )
        learning_rate = self.optimizer.learning_rate
        for g, v in grads_and_vars:
            if g is not None and self._decays(v):
                lr = ops.cast(learning_rate, v.dtype)
                wd = ops.cast(self.weight_decay, v.dtype)
                v.assign(v - v * wd * lr)
        return grads_and_vars

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["weight_decay"] = self.weight_decay
        config["exclude_from_weight_decay"] = self.exclude_from_weight_decay
        return config
