"""LossScaleOptimizer: loss scaling on the RFC 234 pipeline."""

import threading

import keras
from keras import ops

from keras_mp import _config
from keras_mp import loss_scale as loss_scale_module
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers.wrapper import OptimizerWrapper

# Keras 3 used to serialize these base-optimizer arguments for its
# LossScaleOptimizer; configs holding their default values still load.
_KERAS_BASE_DEFAULTS = {
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


def _loss_scale_from_legacy(dynamic, initial_scale, dynamic_growth_steps):
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


def _contains_loss_scale_optimizer(optimizer):
    while True:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return True
        if not isinstance(optimizer, OptimizerWrapper):
            return False
        optimizer = optimizer.inner_optimizer


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(OptimizerWrapper, keras.optimizers.LossScaleOptimizer):
    """An optimizer wrapper that scales the loss so float16 gradients survive.

    float16 flushes values below about 6e-8 to zero, and many gradients are
    that small. Multiplying the loss by a large scale before differentiation
    multiplies every gradient by it too; the optimizer divides it back out in
    float32 before the update. With a dynamic scale, a step whose gradients
    overflow (inf/NaN on any replica) is skipped and the scale lowered:
    weights and every inner optimizer variable stay bit-identical.

    Each step (1) scales the loss (`transform_loss`), (2) unscales the
    aggregated gradients (`transform_gradients`), (3) updates the scale and
    (4) with a dynamic scale skips the update when any gradient is
    non-finite. Two loop styles give the same update: Keras 3's
    (`scale_loss` → gradients → `apply`, as `fit` does) and RFC 293's
    (`get_scaled_loss` → gradients → `get_unscaled_gradients` →
    `apply_gradients`); gradients that went through `get_unscaled_gradients`
    are not divided again.

    It is an instance of `keras.optimizers.LossScaleOptimizer`, so `compile`
    never wraps it twice. Like Keras's class, it clears the inner optimizer's
    `loss_scale_factor`, which would scale the gradients a second time.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        loss_scale: `"dynamic"` (a `DynamicLossScale()`), a number (a
            `FixedLossScale`), a `LossScale` or a loss scale config.
            Defaults to `"dynamic"`.
        aggregate_in_float16: Whether scaled gradients are cast to float16
            for the cross-replica sum (half the traffic) and unscaled in
            float32 afterwards (RFC 293). Defaults to `False`.
        transform_gradients: Gradient transforms, as for
            `OptimizerWrapper`. Defaults to `None`.
        aggregate_gradients: Replacement of the cross-replica sum, as for
            `OptimizerWrapper`. Defaults to `None`.
        name: Name of the optimizer. Defaults to the class name.
        **kwargs: Keras 3's `initial_scale` and `dynamic_growth_steps` and
            tf.keras's `dynamic`, so that existing configs load.

    Example:

    >>> opt = keras_mp.LossScaleOptimizer(
    ...     keras.optimizers.SGD(0.1), loss_scale=keras_mp.DynamicLossScale(8)
    ... )
    >>> float(opt.scale_loss(2.0))
    16.0
    >>> float(opt.get_unscaled_gradients([keras.ops.ones(())])[0])
    0.125
    """

    def __init__(
        self,
        inner_optimizer,
        loss_scale="dynamic",
        aggregate_in_float16=False,
        transform_gradients=None,
        aggregate_gradients=None,
        name=None,
        **kwargs,
    ):
        legacy = {
            key: kwargs.pop(key)
            for key in ("dynamic", "initial_scale", "dynamic_growth_steps")
            if key in kwargs
        }
        for key, default in _KERAS_BASE_DEFAULTS.items():
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
                "aggregate_gradients and name."
            )
        if legacy:
            if loss_scale != "dynamic":
                raise ValueError(
                    "Pass either `loss_scale` or the legacy arguments "
                    f"{sorted(legacy)}, not both. Received: "
                    f"loss_scale={loss_scale!r}, {legacy}"
                )
            loss_scale = _loss_scale_from_legacy(
                legacy.get("dynamic"),
                legacy.get("initial_scale"),
                legacy.get("dynamic_growth_steps"),
            )
        if isinstance(inner_optimizer, keras.optimizers.Optimizer) and (
            _contains_loss_scale_optimizer(inner_optimizer)
        ):
            raise ValueError(
                "The inner optimizer already scales the loss: "
                f"{inner_optimizer!r} is or wraps a LossScaleOptimizer. "
                "Wrap the plain optimizer instead; scaling twice would "
                "square the scale."
            )
        loss_scale = loss_scale_module.get(loss_scale)
        if loss_scale is None:
            raise ValueError(
                "LossScaleOptimizer needs a loss scale. Received: "
                "loss_scale=None. Use the inner optimizer directly to train "
                "without loss scaling."
            )
        if loss_scale.built:
            # Each optimizer owns its scale's variables.
            loss_scale = type(loss_scale).from_config(loss_scale.get_config())
        if not isinstance(aggregate_in_float16, bool):
            raise TypeError(
                "`aggregate_in_float16` must be a bool. Received: "
                f"aggregate_in_float16={aggregate_in_float16!r}"
            )
        super().__init__(
            inner_optimizer,
            transform_gradients=transform_gradients,
            aggregate_gradients=aggregate_gradients,
            name=name,
        )
        self._loss_scale = loss_scale
        self.aggregate_in_float16 = aggregate_in_float16
        self.inner_optimizer.loss_scale_factor = None
        # Per thread: MirroredStrategy traces each replica in its own thread.
        self._unscaled_record = threading.local()

    # ------------------------------------------------------------ properties
    @property
    def loss_scale(self):
        """The `LossScale`; `optimizer.loss_scale()` is the current value."""
        return self._loss_scale

    @property
    def dynamic(self):
        """Whether the loss scale is dynamic (tf.keras's name)."""
        return self._loss_scale.is_dynamic

    @property
    def initial_scale(self):
        """The scale before the first step (Keras 3's name)."""
        if self._loss_scale.is_dynamic:
            return self._loss_scale.initial_loss_scale
        return self._loss_scale.loss_scale_value

    @property
    def dynamic_growth_steps(self):
        """Finite steps before the scale grows (Keras 3's name), or None."""
        return getattr(self._loss_scale, "increment_period", None)

    @property
    def skipped_steps(self):
        """Keras variable counting the steps skipped for non-finite gradients."""
        return self._skipped_steps

    def build_wrapper(self, var_list):
        self._loss_scale.build()
        for variable in self._loss_scale.variables:
            self._track_variable(variable)
        self._skipped_steps = self.add_variable(
            shape=(),
            dtype="int32",
            initializer="zeros",
            aggregation="only_first_replica",
            name="skipped_steps",
        )

    # -------------------------------------------------------------- scaling
    def transform_loss(self, loss):
        loss = super().transform_loss(ops.convert_to_tensor(loss))
        return ops.multiply(loss, self._loss_scale())

    def get_scaled_loss(self, loss):
        """Multiplies `loss` by the loss scale (RFC 293).

        Args:
            loss: A tensor, or a zero-argument callable returning one.

        Returns:
            The scaled loss, or a callable returning it.
        """
        if callable(loss):
            return lambda: self.transform_loss(loss())
        return self.transform_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Divides gradients by the loss scale (RFC 293). None passes through.

        Gradients returned here and then given to `apply_gradients` in the
        same step are not divided a second time.
        """
        reciprocal = self._reciprocal_scale()
        unscaled = [
            None if g is None else self._unscale(g, reciprocal) for g in grads
        ]
        self._unscaled_record.grads = unscaled
        return unscaled

    def _reciprocal_scale(self):
        # One division per step, then a multiply per gradient (as tf.keras
        # did): cheaper than a divide per gradient on CPU, and exact for the
        # powers of two a dynamic scale takes.
        return ops.divide(1.0, self._loss_scale())

    def _unscale(self, grad, reciprocal):
        return backend_gradients.map_gradient(
            lambda values: ops.multiply(
                values, ops.cast(reciprocal, values.dtype)
            ),
            grad,
        )

    def _take_already_unscaled(self, grads):
        record = getattr(self._unscaled_record, "grads", [])
        self._unscaled_record.grads = []
        present = [g for g in grads if g is not None]
        marked = [any(g is r for r in record) for g in present]
        if any(marked) and not all(marked):
            raise ValueError(
                "Some gradients passed to apply_gradients went through "
                "get_unscaled_gradients and others did not. Received "
                f"{sum(marked)} unscaled of {len(present)}. Unscale all of "
                "them, or none (the optimizer then unscales)."
            )
        return bool(present) and all(marked)

    # ------------------------------------------------------------- pipeline
    def apply_gradients(self, grads_and_vars, skip_gradients_aggregation=False):
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        self._already_unscaled = self._take_already_unscaled(
            [g for g, _ in grads_and_vars]
        )
        return super().apply_gradients(
            grads_and_vars,
            skip_gradients_aggregation=skip_gradients_aggregation,
        )

    def aggregate_gradients(self, grads_and_vars):
        if not self.aggregate_in_float16:
            return super().aggregate_gradients(grads_and_vars)
        dtypes = [None if g is None else g.dtype for g, _ in grads_and_vars]
        half = [
            (
                None
                if g is None
                else backend_gradients.map_gradient(
                    lambda x: ops.cast(x, "float16"), g
                ),
                v,
            )
            for g, v in grads_and_vars
        ]
        reduced = super().aggregate_gradients(half)
        return [
            (
                None
                if g is None
                else backend_gradients.map_gradient(
                    lambda x, dtype=dtype: ops.cast(x, dtype), g
                ),
                v,
            )
            for (g, v), dtype in zip(reduced, dtypes)
        ]

    def transform_gradients(self, grads_and_vars):
        if not self._already_unscaled:
            reciprocal = self._reciprocal_scale()
            grads_and_vars = [
                (
                    g
                    if g is None or self._overwrite_variable_with_gradient(v)
                    else self._unscale(g, reciprocal),
                    v,
                )
                for g, v in grads_and_vars
            ]
        return super().transform_gradients(grads_and_vars)

    def run_step(self, grads_and_vars):
        if not self._loss_scale.is_dynamic:
            # A fixed scale never skips (RFC 293).
            super().run_step(grads_and_vars)
            return
        is_finite = _all_finite([g for g, _ in grads_and_vars])
        self.apply_if(is_finite, grads_and_vars)
        self._loss_scale.update(is_finite)
        self._skipped_steps.assign_add(
            ops.cast(ops.logical_not(is_finite), "int32")
        )

    # -------------------------------------------------------- serialization
    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["inner_optimizer"] = config.pop("optimizer")
        config["loss_scale"] = keras.saving.serialize_keras_object(
            self._loss_scale
        )
        config["aggregate_in_float16"] = self.aggregate_in_float16
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # Keras's and tf.keras's name for the wrapped optimizer.
        if isinstance(config, dict) and "optimizer" in config:
            config = dict(config)  # tf.keras's and Keras 3's key.
        else:
            _config.check_config(cls, config, required=("inner_optimizer",))
            config = dict(config)
            config["optimizer"] = config.pop("inner_optimizer")
        return super().from_config(config, custom_objects=custom_objects)


def _all_finite(grads):
    checks = [
        ops.all(ops.isfinite(backend_gradients.gradient_values(g)))
        for g in grads
        if g is not None
    ]
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))
