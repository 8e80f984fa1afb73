"""Checks of what a `LossScaleOptimizer` is given.

Its constructor's arguments, each refused with a message that names the
fix: Keras 3's and tf.keras's (read into a `LossScale` by
`legacy_arguments.py`) and the base-optimizer arguments it does not take,
an inner optimizer that scales the loss already
(`contains_loss_scale_optimizer`, which `models.py`'s `compile` asks too),
the bool flags, and the loss scale itself: a fixed 1 where
`skip_nonfinite=True` is given none, and never one that another live
LossScaleOptimizer owns.
"""

import keras

from keras_mp import loss_scale as loss_scale_module
from keras_mp.optimizers import legacy_arguments
from keras_mp.optimizers.wrapper import OptimizerWrapper


def contains_loss_scale_optimizer(optimizer):
    """Whether `optimizer` is, or wraps, a LossScaleOptimizer (Keras's or
    keras_mp's)."""
    while True:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return True
        if not isinstance(optimizer, OptimizerWrapper):
            return False
        optimizer = optimizer.inner_optimizer


def checked_loss_scale(inner_optimizer, loss_scale, name, flags, kwargs):
    """The `LossScale` a LossScaleOptimizer is given, its arguments checked.

    Args:
        inner_optimizer: Its `inner_optimizer` argument.
        loss_scale: Its `loss_scale` argument.
        name: Its `name` argument.
        flags: `{argument name: value}` of its bool arguments,
            `skip_nonfinite` among them.
        kwargs: Its other keyword arguments: Keras 3's and tf.keras's
            (popped), nothing else.
    """
    legacy = {
        key: kwargs.pop(key)
        for key in ("dynamic", "initial_scale", "dynamic_growth_steps")
        if key in kwargs
    }
    for key, default in legacy_arguments.KERAS_BASE_DEFAULTS.items():
        if key in kwargs and kwargs.pop(key) != default:
            raise ValueError(
                f"LossScaleOptimizer does not support `{key}`. Instead, "
                f"set `{key}` on the `inner_optimizer`."
            )
    if kwargs:
        raise ValueError(
            "LossScaleOptimizer does not support arguments: "
            f"`{'`, `'.join(kwargs)}`. It takes inner_optimizer, "
            "loss_scale, aggregate_in_float16, transform_gradients, "
            "aggregate_gradients, name, track_overflow, state_dtype, "
            "stochastic_rounding, master_weights, skip_on_device, "
            "skip_nonfinite and max_consecutive_skips."
        )
    if legacy:
        if loss_scale != "dynamic":
            raise ValueError(
                "Pass either `loss_scale` or the legacy arguments "
                f"{sorted(legacy)}, not both. Received: "
                f"loss_scale={loss_scale!r}, {legacy}"
            )
        loss_scale = legacy_arguments.loss_scale_from_legacy(
            legacy.get("dynamic"),
            legacy.get("initial_scale"),
            legacy.get("dynamic_growth_steps"),
        )
    if isinstance(inner_optimizer, keras.optimizers.Optimizer) and (
        contains_loss_scale_optimizer(inner_optimizer)
    ):
        raise ValueError(
            "The inner optimizer already scales the loss: "
            f"{inner_optimizer!r} is or wraps a LossScaleOptimizer. "
            "Wrap the plain optimizer instead; scaling twice would "
            "square the scale."
        )
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(
                f"`{flag}` must be a bool. Received: {flag}={value!r}"
            )
    if loss_scale is None and flags["skip_nonfinite"]:
        loss_scale = 1
    loss_scale = loss_scale_module.get(loss_scale)
    if loss_scale is None:
        raise ValueError(
            "LossScaleOptimizer needs a loss scale. Received: "
            "loss_scale=None. Use the inner optimizer directly to train "
            "without loss scaling, or pass skip_nonfinite=True to skip "
            "non-finite steps without it."
        )
    _claim(loss_scale, name)
    return loss_scale


def _claim(loss_scale, name):
    """Refuses a loss scale that another live optimizer already owns."""
    owner = getattr(loss_scale, "_keras_mp_owner", None)
    owner = owner() if owner is not None else None
    if owner is not None:
        raise ValueError(
            f"This {type(loss_scale).__name__} already belongs to the "
            f"LossScaleOptimizer {owner.name!r}; two optimizers sharing it "
            "would share its state (an overflow in one would lower the "
            "other's scale). Received: loss_scale="
            f"{loss_scale!r} for optimizer {name or 'LossScaleOptimizer'!r}. "
            "Give each optimizer its own loss scale, e.g. "
            "`keras_mp.DynamicLossScale(...)` twice, or "
            "`type(scale).from_config(scale.get_config())`."
        )
