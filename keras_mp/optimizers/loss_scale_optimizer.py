"""LossScaleOptimizer: loss scaling on the RFC 234 pipeline."""

import collections
import threading
import warnings
import weakref

import keras
import numpy as np
from keras import ops

from keras_mp import _config
from keras_mp import _keras_internals
from keras_mp import loss_scale as loss_scale_module
from keras_mp.backend import collectives
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient
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
        track_overflow: Whether to count, for every trainable variable, the
            steps whose gradient for it was non-finite and the first such
            step, in two integer variables updated inside the step (no host
            round trip); `overflow_report()` reads them. Defaults to
            `False`.
        state_dtype: Dtype of the inner optimizer's slot variables, e.g.
            `"bfloat16"` (half of float32 Adam's state); the update still
            computes in float32. As for `OptimizerWrapper`. Defaults to
            `None` (the trainable variables' dtype).
        stochastic_rounding: Whether bfloat16 state is stored with
            stochastic rounding, as for `OptimizerWrapper`. Defaults to
            `None` (True for bfloat16 state).
        master_weights: Whether to keep a float32 master copy of every
            bfloat16/float16 trainable variable, updated by the inner
            optimizer and rounded into the variable after each applied
            step, as for `OptimizerWrapper`. Defaults to `False`.
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
        track_overflow=False,
        state_dtype=None,
        stochastic_rounding=None,
        master_weights=False,
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
                "aggregate_gradients, name, track_overflow, state_dtype, "
                "stochastic_rounding and master_weights."
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
        _claim(loss_scale, name)
        for flag, value in (
            ("aggregate_in_float16", aggregate_in_float16),
            ("track_overflow", track_overflow),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{flag}` must be a bool. Received: {flag}={value!r}"
                )
        super().__init__(
            inner_optimizer,
            transform_gradients=transform_gradients,
            aggregate_gradients=aggregate_gradients,
            name=name,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            master_weights=master_weights,
        )
        self._loss_scale = loss_scale
        self.aggregate_in_float16 = aggregate_in_float16
        self.track_overflow = track_overflow
        self.inner_optimizer.loss_scale_factor = None
        loss_scale._keras_mp_owner = weakref.ref(self)
        # What happened since the last `apply_gradients`, per thread:
        # MirroredStrategy traces each replica in its own thread.
        self._step_record = _StepRecord()
        self._warned_unscaled_loss = False
        # Host-side state of `check_min_scale`: skipped steps at its last
        # look, and whether it warned already.
        self._min_scale_checked_skips = None
        self._warned_min_scale = False

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
        if self._accumulation_steps():
            # Whether every micro-step of the current accumulation window
            # had finite gradients (1) or not (0).
            self._window_finite = self.add_variable(
                shape=(),
                dtype="int32",
                initializer="ones",
                aggregation="only_first_replica",
                name="window_finite",
            )
        if self.track_overflow:
            # One entry per trainable variable, in `var_list` order: two
            # variables in all, however large the model.
            count = len(self._trainable_variables)
            self._overflow_counts = self.add_variable(
                shape=(count,),
                dtype="int32",
                initializer="zeros",
                aggregation="only_first_replica",
                name="overflow_counts",
            )
            self._overflow_first_steps = self.add_variable(
                shape=(count,),
                dtype="int32",
                initializer=keras.initializers.Constant(-1),
                aggregation="only_first_replica",
                name="overflow_first_steps",
            )

    # -------------------------------------------------------------- scaling
    def transform_loss(self, loss):
        loss = super().transform_loss(ops.convert_to_tensor(loss))
        # Recorded when the step is built (traced, or run eagerly): the
        # gradients that reach `apply_gradients` next are of a scaled loss.
        self._step_record.loss_scaled = True
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

        After this call, the next `apply_gradients` (the same step) does not
        divide again, whatever is done to the gradients in between
        (clipping, scaling, casting): the call is recorded, not the tensors.
        """
        unscaled = backend_gradients.multiply_all(
            list(grads), self._reciprocal_scale()
        )
        self._step_record.gradients_unscaled = True
        return unscaled

    def _reciprocal_scale(self):
        # One division per step, then a multiply per gradient (as tf.keras
        # did): cheaper than a divide per gradient on CPU, and exact for the
        # powers of two a dynamic scale takes.
        return ops.divide(1.0, self._loss_scale())

    def _gradients_need_unscaling(self):
        """Whether the gradients now given to `apply_gradients` are scaled.

        Three cases, from what this optimizer did since the last update:
        `get_unscaled_gradients` ran (RFC 293 loop: already unscaled), or
        the loss went through `scale_loss`/`get_scaled_loss`/`minimize`
        (Keras 3 loop, as in `fit`: unscale now), or neither: gradients of
        a loss that was never scaled (the custom `train_step` of Keras's
        guides), applied as they are, as tf.keras did, with a warning since
        float16 gradients then get no protection from underflow.
        """
        record = self._step_record
        unscaled, scaled = record.gradients_unscaled, record.loss_scaled
        record.gradients_unscaled = record.loss_scaled = False
        if unscaled:
            return False
        if scaled:
            return True
        if not self._warned_unscaled_loss:
            self._warned_unscaled_loss = True
            warnings.warn(
                f"LossScaleOptimizer {self.name!r} received gradients of a "
                "loss it did not scale: no `scale_loss`, `get_scaled_loss` "
                "or `minimize` call came before `apply_gradients`/`apply`. "
                "They are applied as they are (not divided by the loss "
                "scale), so the update is right, but float16 gradients are "
                "not protected from underflow. To scale the loss, write "
                "`loss = self.optimizer.scale_loss(loss)` before taking "
                "gradients in your `train_step` (or use `minimize`); "
                "gradients of a loss you scaled yourself must be passed "
                "through `get_unscaled_gradients` first.",
                stacklevel=4,
            )
        return False

    # ------------------------------------------------------------- pipeline
    def apply_gradients(self, grads_and_vars, skip_gradients_aggregation=False):
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        self._unscale_in_step = self._gradients_need_unscaling()
        return super().apply_gradients(
            grads_and_vars,
            skip_gradients_aggregation=skip_gradients_aggregation,
        )

    def aggregate_gradients(self, grads_and_vars):
        if not self.aggregate_in_float16:
            return super().aggregate_gradients(grads_and_vars)
        # Never a silent no-op: on PyTorch only a callable can sum in float16.
        collectives.check_float16_aggregation(
            self._aggregate_gradients_fn is not None
        )
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
        if self._unscale_in_step:
            # Part of the update that `apply_if` guards (see `run_step`), so
            # under XLA the multiply fuses with the optimizer's elementwise
            # update. Gradients that overwrite their variable never get here
            # (see `split_overwritten`).
            unscaled = backend_gradients.multiply_all(
                [g for g, _ in grads_and_vars], self._reciprocal_scale()
            )
            grads_and_vars = list(zip(unscaled, [v for _, v in grads_and_vars]))
        return super().transform_gradients(grads_and_vars)

    def run_step(self, grads_and_vars):
        if not self._loss_scale.is_dynamic:
            # A fixed scale never skips (RFC 293).
            super().run_step(grads_and_vars)
            return
        grads = [g for g, _ in grads_and_vars]
        if self.track_overflow:
            finite_per_gradient = _finite_per_gradient(grads)
            is_finite = _all_of(finite_per_gradient)
            # Before the update: the step number is the count of steps
            # applied and skipped so far.
            self._track_overflow(grads_and_vars, finite_per_gradient)
        else:
            # One sum per gradient, checked once (see `all_finite`).
            is_finite = backend_gradients.all_finite(grads)
        if self._accumulation_steps():
            self._run_accumulation_step(grads_and_vars, is_finite)
            return
        self.apply_if(is_finite, grads_and_vars)
        self._loss_scale.update(is_finite)
        self._skipped_steps.assign_add(
            ops.cast(ops.logical_not(is_finite), "int32")
        )

    def _accumulation_steps(self):
        return getattr(self._base_optimizer(), "gradient_accumulation_steps", 0)

    def _run_accumulation_step(self, grads_and_vars, is_finite):
        """One micro-step of an inner optimizer that accumulates gradients.

        As in torch AMP's recipe: each micro-step's gradients are unscaled
        before the inner optimizer accumulates them; a window with any
        non-finite micro-step is discarded whole at its last micro-step
        (weights and slots unchanged, accumulators emptied, one skipped
        step); the loss scale is updated once per window, from all of it.
        """
        base = self._base_optimizer()
        steps = base.gradient_accumulation_steps
        # Under DDP's `no_sync` each process's micro-step gradients are its
        # own: the window's verdict must be every process's.
        is_finite = collectives.all_processes_finite(is_finite)
        window_finite = ops.logical_and(
            ops.cast(self._window_finite.value, "bool"), is_finite
        )
        # Keras counts micro-steps in `_iterations` (`iterations` is that
        # floor-divided by `steps`).
        micro_steps = base._iterations
        last = ops.equal(
            ops.mod(ops.cast(micro_steps.value, "int32") + 1, steps), 0
        )
        # Non-finite micro-gradients are accumulated as zeros (the window
        # is discarded anyway), so the accumulators stay finite.
        safe = [
            (
                None
                if g is None
                else backend_gradients.map_gradient(
                    lambda x: ops.where(is_finite, x, ops.zeros_like(x)), g
                ),
                v,
            )
            for g, v in grads_and_vars
        ]
        self.apply_if(
            ops.logical_or(ops.logical_not(last), window_finite), safe
        )
        discard = ops.logical_and(last, ops.logical_not(window_finite))
        for accumulator in _keras_internals.accumulated_gradients(base):
            value = accumulator.value
            accumulator.assign(ops.where(discard, ops.zeros_like(value), value))
        # A discarded window starts again: `iterations` counts applied
        # updates only.
        micro_steps.assign(
            ops.where(
                discard, micro_steps.value - (steps - 1), micro_steps.value
            )
        )
        self._update_loss_scale_where(last, window_finite)
        self._window_finite.assign(
            ops.cast(ops.logical_or(last, window_finite), "int32")
        )
        self._skipped_steps.assign_add(ops.cast(discard, "int32"))

    def _update_loss_scale_where(self, condition, is_finite):
        """`loss_scale.update(is_finite)` where `condition` holds, else none."""
        variables = self._loss_scale.variables
        current = [v.value for v in variables]
        with keras.StatelessScope(
            state_mapping=list(zip(variables, current))
        ) as scope:
            self._loss_scale.update(is_finite)
        for variable, old in zip(variables, current):
            variable.assign(
                ops.where(condition, scope.get_current_value(variable), old)
            )

    def _track_overflow(self, grads_and_vars, finite_per_gradient):
        flags = [False] * len(self._trainable_variables)
        checks = iter(finite_per_gradient)
        for grad, variable in grads_and_vars:
            if grad is None:
                continue
            finite = next(checks)
            # A non-finite amax history still skips the step, but is not
            # the overflow to report: the gradient it came from is.
            if not overwrites_with_gradient(variable):
                flags[self._get_variable_index(variable)] = ops.logical_not(
                    finite
                )
        overflowed = ops.stack(
            [ops.convert_to_tensor(flag, "bool") for flag in flags]
        )
        step = ops.add(
            ops.cast(self.iterations, "int32"),
            ops.convert_to_tensor(self._skipped_steps.value, "int32"),
        )
        counts = ops.convert_to_tensor(self._overflow_counts.value, "int32")
        first = ops.convert_to_tensor(self._overflow_first_steps.value, "int32")
        self._overflow_counts.assign(counts + ops.cast(overflowed, "int32"))
        self._overflow_first_steps.assign(
            ops.where(
                ops.logical_and(overflowed, ops.less(first, 0)), step, first
            )
        )

    # ------------------------------------------------------------- reports
    def overflow_report(self, top=10):
        """Which variables' gradients overflowed, worst first.

        Needs `track_overflow=True`. Reads two small integer variables
        (one host copy); call it between steps, not inside one.

        Args:
            top: How many records to return at most, or None for all.
                Defaults to `10`.

        Returns:
            An `OverflowRecords` list of `OverflowRecord(path, layer, count,
            first_step)`, most overflows first (then earliest); only
            variables whose gradient was non-finite at least once. `str()`
            of it is a table. `first_step` counts every step, applied or
            skipped, from 0.
        """
        if not self.track_overflow:
            raise ValueError(
                "overflow_report() needs an optimizer created with "
                "track_overflow=True. Received an optimizer with "
                "track_overflow=False. Create it as "
                "keras_mp.LossScaleOptimizer(..., track_overflow=True)."
            )
        if not self.built:
            return OverflowRecords([])
        counts, first_steps = (
            np.asarray(ops.convert_to_numpy(v.value))
            for v in (self._overflow_counts, self._overflow_first_steps)
        )
        return overflow_records(
            self._trainable_variables, counts, first_steps, top
        )

    def check_min_scale(self, skipped_steps=None, loss_scale=None):
        """Applies the loss scale's `on_min_scale` policy, on the host.

        Steps that overflow while the dynamic scale sits at its
        `min_loss_scale` cannot be rescued by lowering it. When more steps
        were skipped since the last check and the scale is at its floor,
        this warns once (`"warn"`), raises `FloatingPointError`
        (`"raise"`) or does nothing (`"ignore"`). `fit` calls it through
        `LossScaleLogger` each time that reads the state (once per epoch by
        default); call it yourself every few steps in your own loop.

        Args:
            skipped_steps: The current `skipped_steps` value, if already read
                (saves a host copy). Defaults to reading it.
            loss_scale: The current scale value, if already read. Defaults
                to reading it.
        """
        scale = self._loss_scale
        if not scale.is_dynamic or not self.built:
            return
        if skipped_steps is None:
            skipped_steps = int(ops.convert_to_numpy(self._skipped_steps.value))
        if loss_scale is None:
            loss_scale = float(ops.convert_to_numpy(scale()))
        previous = self._min_scale_checked_skips
        self._min_scale_checked_skips = skipped_steps
        if (
            scale.on_min_scale == "ignore"
            or loss_scale > scale.min_loss_scale
            or previous is None
            or skipped_steps <= previous
        ):
            return
        message = (
            f"LossScaleOptimizer {self.name!r}: {skipped_steps - previous} "
            "more step(s) were skipped for non-finite gradients and the loss "
            f"scale sits at its min_loss_scale={scale.min_loss_scale:g}, "
            "where lowering it cannot help: the loss or the model overflows "
            "in 16 bits by itself."
        )
        if self.track_overflow:
            worst = self.overflow_report(top=3)
            if worst:
                names = ", ".join(f"{r.path} ({r.count}x)" for r in worst)
                message += f" Worst variables: {names}."
        message += (
            " Compute the overflowing layers in float32 (dtype='float32' on "
            "the layer, or a float32 loss), lower min_loss_scale, or use "
            "mixed_bfloat16. Set on_min_scale='ignore' on the "
            "DynamicLossScale to silence this."
        )
        if scale.on_min_scale == "raise":
            raise FloatingPointError(message)
        if not self._warned_min_scale:
            self._warned_min_scale = True
            warnings.warn(message, stacklevel=2)

    # -------------------------------------------------------- serialization
    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["inner_optimizer"] = config.pop("optimizer")
        config["loss_scale"] = keras.saving.serialize_keras_object(
            self._loss_scale
        )
        config["aggregate_in_float16"] = self.aggregate_in_float16
        config["track_overflow"] = self.track_overflow
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


class _StepRecord(threading.local):
    loss_scaled = False
    gradients_unscaled = False


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


def _finite_per_gradient(grads):
    """One bool scalar per gradient that is not None: all its values finite."""
    return [
        ops.isfinite(backend_gradients.gradient_sum(g))
        for g in grads
        if g is not None
    ]


def _all_of(checks):
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))


class OverflowRecord(
    collections.namedtuple(
        "OverflowRecord", ["path", "layer", "count", "first_step"]
    )
):
    """One variable of `LossScaleOptimizer.overflow_report()`.

    Attributes:
        path: The variable's path, e.g. `"dense_1/kernel"`.
        layer: The name of the layer that owns it (the path's parent).
        count: Steps whose gradient for it was non-finite.
        first_step: The first such step, counting every step from 0.
    """

    __slots__ = ()


class OverflowRecords(list):
    """A list of `OverflowRecord`s whose `str()` is a readable table."""

    def __str__(self):
        if not self:
            return "No gradient overflowed."
        header = ("variable", "layer", "overflows", "first step")
        rows = [header] + [
            (r.path, r.layer, str(r.count), str(r.first_step)) for r in self
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(
                cell.ljust(width) if i < 2 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(lines)


def overflow_records(variables, counts, first_steps, top=None):
    """The `OverflowRecords` of counters read from a tracking optimizer."""
    records = [
        OverflowRecord(
            path=variable.path,
            layer=variable.path.rsplit("/", 2)[-2]
            if "/" in variable.path
            else "",
            count=int(count),
            first_step=int(first),
        )
        for variable, count, first in zip(variables, counts, first_steps)
        if count > 0
    ]
    records.sort(key=lambda r: (-r.count, r.first_step, r.path))
    return OverflowRecords(records if top is None else records[:top])
