"""Keras 3's and tf.keras's LossScaleOptimizer arguments, read by keras_mp's.

Keras 3's `initial_scale`/`dynamic_growth_steps`, tf.keras's `dynamic`,
and the base-optimizer arguments Keras 3 used to serialize, so that
existing configs load. Imports `keras_mp.loss_scale`; never another
module of `optimizers/`.
"""

from keras_mp import loss_scale as loss_scale_module

# Keras 3 used to serialize these base-optimizer arguments for its
# LossScaleOptimizer; configs holding their default values still load.
KERAS_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def loss_scale_from_legacy(dynamic, initial_scale, dynamic_growth_steps):
    """The LossScale of Keras 3 (`initial_scale`, `dynamic_growth_steps`) and
    tf.keras (`dynamic`) constructor arguments."""
    if dynamic is None or dynamic:
        kwargs = {}
        if initial_scale is not None:
            kwargs["initial_loss_scale"] = initial_scale
        if dynamic_growth_steps is not None:
            kwargs["increment_period"] = dynamic_growth_steps
        try:
            return loss_scale_module.DynamicLossScale(**kwargs)
        except (TypeError, ValueError) as error:
            raise type(error)(_in_legacy_names(str(error))) from None
    if dynamic_growth_steps is not None:
        raise ValueError(
            "`dynamic_growth_steps` only applies to a dynamic loss scale. "
            f"Received: dynamic=False, dynamic_growth_steps="
            f"{dynamic_growth_steps!r}. Remove it, or set dynamic=True."
        )
    if initial_scale is None:
        raise ValueError(
            "dynamic=False needs the fixed scale as `initial_scale`. "
            "Received: initial_scale=None. Pass e.g. initial_scale=128, or "
            "loss_scale=128."
        )
    try:
        return loss_scale_module.FixedLossScale(initial_scale)
    except (TypeError, ValueError) as error:
        raise type(error)(_in_legacy_names(str(error))) from None


def _in_legacy_names(message):
    # The user wrote Keras 3's names; the error must not name DynamicLossScale's.
    for name, legacy in (
        ("initial_loss_scale", "initial_scale"),
        ("loss_scale_value", "initial_scale"),
        ("increment_period", "dynamic_growth_steps"),
    ):
        message = message.replace(name, legacy)
    return message
