"""LossScaleOptimizer: loss scaling on the RFC 234 pipeline.

Scaling the loss, unscaling the gradients (once, whichever loop style),
the finite check and the skip decision, the loss scale's update, the
Keras 3 / tf.keras names of the scale (`dynamic`, `initial_scale`,
`dynamic_growth_steps`), and the skip without a loss scale
(`skip_nonfinite`). Composes `accumulation.py` (windows),
`overflow.py` (counters, reports), `consecutive_skips.py` (the stop after
skipped steps in a row), `host_skip.py` (PyTorch's default step, decided
on the host) and `fp8_carriers.py` (FP8 carriers free of the loss scale,
and the next step's loss scale written into delayed ones);
`loss_scale_inputs.py` checks its constructor's arguments (Keras 3's and
tf.keras's read by `legacy_arguments.py`). Imports those, `wrapper.py`,
`keras_mp.loss_scale` and `keras_mp.backend`; never `models.py`,
`callbacks.py` or `recommend`.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from keras_mp import _config
from keras_mp import loss_scale as loss_scale_module
from keras_mp.backend import collectives
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers import consecutive_skips
from keras_mp.optimizers import loss_scale_inputs
from keras_mp.optimizers import overflow
from keras_mp.optimizers.accumulation import AccumulationMixin
from keras_mp.optimizers.consecutive_skips import ConsecutiveSkipsMixin
from keras_mp.optimizers.fp8_carriers import FP8CarriersMixin
from keras_mp.optimizers.host_skip import HostSkipMixin
from keras_mp.optimizers.overflow import OverflowTrackingMixin
from keras_mp.optimizers.wrapper import GradsAndVars
from keras_mp.optimizers.wrapper import OptimizerWrapper


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(
    OptimizerWrapper,
    AccumulationMixin,
    OverflowTrackingMixin,
    ConsecutiveSkipsMixin,
    HostSkipMixin,
    FP8CarriersMixin,
    keras.optimizers.LossScaleOptimizer,
):
    """An optimizer wrapper that scales the loss so float16 gradients survive.

    float16 flushes values below about 6e-8 to zero, and many gradients are
    that small. Multiplying the loss by a large scale before differentiation
    multiplies every gradient by it too; the optimizer divides it back out in
    float32 before the update. With a dynamic scale, a step whose gradients
    overflow (inf/NaN on any replica) is skipped and the scale lowered:
    weights and every inner optimizer variable stay bit-identical.

    Where the skip is decided: on TensorFlow and JAX inside the compiled
    step (`tf.cond`, `lax.cond`). On PyTorch, whose steps run eagerly, by
    default the gradients are checked and unscaled in one fused pass
    (torch.amp's `GradScaler` kernel; a gradient that is its variable's
    `.grad`, as in `fit`, is unscaled in place, as `GradScaler.unscale_`
    does), the finite flag is read on the host (free on CPU tensors, one
    small read per step on an accelerator, as `GradScaler` and Keras's
    LossScaleOptimizer make), and the inner optimizer updates or not: no
    copy of the state, and finite steps bit-identical to Keras's class.
    `skip_on_device=True` opts into a step with no host read, which saves
    every weight and slot and selects after the update.

    Each step (1) scales the loss (`transform_loss`), (2) unscales the
    aggregated gradients (`transform_gradients`), (3) updates the scale and
    (4) with a dynamic scale skips the update when any gradient is
    non-finite. Two loop styles give the same update: Keras 3's
    (`scale_loss` → gradients → `apply`, as `fit` does) and RFC 293's
    (`get_scaled_loss` → gradients → `get_unscaled_gradients` →
    `apply_gradients`); gradients that went through `get_unscaled_gradients`
    are not divided again.

    With `skip_nonfinite=True` and `loss_scale=1` it is the skip without
    loss scaling that `compile` gives models under FP8 recipes
    (`keras_mp.set_global_policy(..., skip_nonfinite=...)`): nothing is
    multiplied or divided (a scale of 1 costs no pass over the gradients),
    and a step whose gradients hold an inf or NaN is skipped and counted
    exactly as with a dynamic scale (the same finite check, the same skip
    on every backend, `skipped_steps`, `track_overflow`).

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
            round trip of their own; on PyTorch's default skip, only on the
            steps that overflow); `overflow_report()` reads them. Defaults
            to `False`.
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
        skip_on_device: Whether, on PyTorch, the skip is decided without
            reading the finite flag on the host, so an accelerator's queue
            never waits for the host: every weight and slot is saved before
            the in-place update and selected after it (one copy of the
            state per step). With Keras's own Adam or AdamW (no clipping,
            EMA or accumulation on it, no stateful transforms, slots in the
            variables' dtype) the update is instead torch's fused AdamW
            kernel, which leaves the state untouched on a skipped step; it
            adds epsilon after the bias correction, so each update differs
            from Keras's by a relative `epsilon / (sqrt(v) + epsilon)` at
            most. On TensorFlow and JAX it is accepted and changes nothing:
            their skip is always decided on the device. Defaults to
            `False`.
        skip_nonfinite: Whether a step with a non-finite gradient is
            skipped (weights and every optimizer variable left
            bit-identical, `skipped_steps` counted) whatever the loss scale:
            with a fixed scale too, which RFC 293 otherwise applies
            unconditionally. A dynamic scale always skips. With it,
            `loss_scale=None` means a fixed scale of 1 (no scaling).
            Defaults to `False`.
        max_consecutive_skips: After this many steps skipped in a row,
            `fit` stops with `FloatingPointError` naming the layers whose
            gradients overflowed most (with `track_overflow=True`): the
            count is kept inside the step, and checked on the host at the
            end of each batch (`check_consecutive_skips()`). An int >= 1,
            None (never stop), or `"auto"`: 2 with `skip_nonfinite=True`
            and a fixed scale (where Megatron-LM and DeepSpeed meet, see
            `keras_mp/optimizers/consecutive_skips.py`), None otherwise (a
            dynamic scale's `on_min_scale` covers it). Settable before the
            first step. Defaults to `"auto"`.
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
        inner_optimizer: keras.optimizers.Optimizer,
        loss_scale: loss_scale_module.LossScaleLike = "dynamic",
        aggregate_in_float16: bool = False,
        transform_gradients: Any = None,
        aggregate_gradients: Callable[[GradsAndVars], Iterable[tuple[Any, Any]]]
        | None = None,
        name: str | None = None,
        track_overflow: bool = False,
        state_dtype: str | None = None,
        stochastic_rounding: bool | None = None,
        master_weights: bool = False,
        skip_on_device: bool = False,
        skip_nonfinite: bool = False,
        max_consecutive_skips: int | str | None = "auto",
        **kwargs: Any,
    ) -> None:
        loss_scale = loss_scale_inputs.checked_loss_scale(
            inner_optimizer,
            loss_scale,
            name,
            {
                "aggregate_in_float16": aggregate_in_float16,
                "track_overflow": track_overflow,
                "skip_on_device": skip_on_device,
                "skip_nonfinite": skip_nonfinite,
            },
            kwargs,
        )
        max_consecutive_skips = consecutive_skips.check_max_consecutive_skips(
            max_consecutive_skips, skip_nonfinite, loss_scale
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
        self.skip_on_device = skip_on_device
        self.skip_nonfinite = skip_nonfinite
        self._max_consecutive_skips = max_consecutive_skips
        self._consecutive_skips = None
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
    def loss_scale(self) -> loss_scale_module.LossScale:
        """The `LossScale`; `optimizer.loss_scale()` is the current value."""
        return self._loss_scale

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic (tf.keras's name)."""
        return self._loss_scale.is_dynamic

    @property
    def initial_scale(self) -> float:
        """The scale before the first step (Keras 3's name)."""
        if self._loss_scale.is_dynamic:
            return self._loss_scale.initial_loss_scale
        return self._loss_scale.loss_scale_value

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Finite steps before the scale grows (Keras 3's name), or None."""
        return getattr(self._loss_scale, "increment_period", None)

    @property
    def skipped_steps(self) -> keras.Variable:
        """Keras variable counting the steps skipped for non-finite gradients."""
        return self._skipped_steps

    def build_wrapper(self, var_list: list[keras.Variable]) -> None:
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
        self._build_accumulation()
        self._build_overflow_tracking()
        self._build_consecutive_skips()

    # -------------------------------------------------------------- scaling
    def _scales_by_one(self) -> bool:
        """Whether the scale is a fixed 1: nothing to multiply or divide."""
        return (
            isinstance(self._loss_scale, loss_scale_module.FixedLossScale)
            and self._loss_scale.loss_scale_value == 1.0
        )

    def transform_loss(self, loss: Any) -> Any:
        loss = super().transform_loss(ops.convert_to_tensor(loss))
        # Recorded when the step is built (traced, or run eagerly): the
        # gradients that reach `apply_gradients` next are of a scaled loss.
        self._step_record.loss_scaled = True
        if self._scales_by_one():
            return loss
        return ops.multiply(loss, self._loss_scale())

    def get_scaled_loss(self, loss: Any) -> Any:
        """Multiplies `loss` by the loss scale (RFC 293).

        Args:
            loss: A tensor, or a zero-argument callable returning one.

        Returns:
            The scaled loss, or a callable returning it.
        """
        if callable(loss):
            return lambda: self.transform_loss(loss())
        return self.transform_loss(loss)

    def get_unscaled_gradients(self, grads: Sequence[Any]) -> list[Any]:
        """Divides gradients by the loss scale (RFC 293). None passes through.

        After this call, the next `apply_gradients` (the same step) does not
        divide again, whatever is done to the gradients in between
        (clipping, scaling, casting): the call is recorded, not the tensors.
        """
        if self._scales_by_one():
            unscaled = list(grads)
        else:
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
        if unscaled or self._scales_by_one():
            # A scale of 1 leaves every gradient as it is, scaled or not.
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
    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Any]],
        skip_gradients_aggregation: bool = False,
    ) -> Any:
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        self._record_carriers_divided()
        self._unscale_in_step = self._gradients_need_unscaling()
        return super().apply_gradients(
            grads_and_vars,
            skip_gradients_aggregation=skip_gradients_aggregation,
        )

    def aggregate_gradients(self, grads_and_vars: GradsAndVars) -> GradsAndVars:
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

    def transform_gradients(self, grads_and_vars: GradsAndVars) -> GradsAndVars:
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

    def run_step(self, grads_and_vars: GradsAndVars) -> Any:
        before = self._step_counters()
        self._run_loss_scaled_step(grads_and_vars)
        self._count_consecutive_skips(before)
        self._write_loss_scale_into_carriers(grads_and_vars)
        self._check_skips_after_step()

    def _run_loss_scaled_step(self, grads_and_vars):
        grads_and_vars = self._carriers_free_of_loss_scale(grads_and_vars)
        if not self._loss_scale.is_dynamic and not self.skip_nonfinite:
            # A fixed scale never skips (RFC 293), unless asked to.
            super().run_step(grads_and_vars)
            return
        if self._skips_on_host():
            self._run_step_on_host(grads_and_vars)
            return
        if self._runs_fused_adam(grads_and_vars):
            self._run_fused_adam_step(grads_and_vars)
            return
        grads = [g for g, _ in grads_and_vars]
        if self.track_overflow:
            finite_per_gradient = overflow.finite_per_gradient(grads)
            is_finite = overflow.all_of(finite_per_gradient)
            # Before the update: the step number is the count of steps
            # applied and skipped so far.
            self._track_overflow(grads_and_vars, finite_per_gradient)
        else:
            # One sum per gradient, checked once (see `all_finite`).
            is_finite = backend_gradients.all_finite(grads)
        # Every process decides alike, whatever its own gradients were
        # (under DDP's `no_sync` they are its own).
        is_finite = collectives.all_processes_finite(is_finite)
        if self._accumulation_steps():
            self._run_accumulation_step(
                grads_and_vars, is_finite, self._accumulation_flags(is_finite)
            )
            return
        self.apply_if(is_finite, grads_and_vars)
        self._loss_scale.update(is_finite)
        self._skipped_steps.assign_add(
            ops.cast(ops.logical_not(is_finite), "int32")
        )

    # -------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["inner_optimizer"] = config.pop("optimizer")
        config["loss_scale"] = keras.saving.serialize_keras_object(
            self._loss_scale
        )
        config["aggregate_in_float16"] = self.aggregate_in_float16
        config["track_overflow"] = self.track_overflow
        config["skip_on_device"] = self.skip_on_device
        config["skip_nonfinite"] = self.skip_nonfinite
        config["max_consecutive_skips"] = self._max_consecutive_skips
        return config

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        custom_objects: dict[str, Any] | None = None,
    ) -> LossScaleOptimizer:
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
