"""Loss scales: how much to multiply the loss by before taking gradients."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any
from typing import TypeVar

import keras
from keras import ops

from keras_mp import _config
from keras_mp._keras_internals import constant
from keras_mp._scaler_import import from_deepspeed as _from_deepspeed
from keras_mp._scaler_import import from_torch as _from_torch

_T = TypeVar("_T", bound="LossScale")


class LossScale:
    """Base class of loss scales.

    A loss scale is a value to multiply the loss by before computing
    gradients, so that small float16 gradients do not flush to zero, and to
    divide the gradients by afterwards. `update(is_finite)` is called once per
    step with whether the aggregated gradients were all finite; it updates the
    scale's state and answers whether the step's gradients should be applied.

    State lives in Keras variables created by `build()`, which an optimizer
    calls inside its own `build` (so the variables belong to the optimizer's
    distribution strategy and travel through JAX stateless steps).
    """

    def __init__(self) -> None:
        self._variables: list[Any] = []
        self.built = False

    def build(self) -> None:
        """Creates the state variables. Safe to call more than once."""
        self.built = True

    @property
    def variables(self) -> list[keras.Variable]:
        """The state variables, in checkpoint order."""
        return list(self._variables)

    def _add_variable(self, name, value, dtype):
        # "only_first_replica": every replica computes the same update from
        # the same aggregated gradients, so any replica's value is the value.
        variable = keras.Variable(
            value,
            dtype=dtype,
            trainable=False,
            name=name,
            aggregation="only_first_replica",
        )
        self._variables.append(variable)
        return variable

    def __call__(self) -> Any:
        """Returns the current loss scale as a float32 scalar tensor."""
        raise NotImplementedError

    def update(self, is_finite: Any) -> Any:
        """Updates the state after a step and says whether to apply it.

        Args:
            is_finite: Boolean scalar tensor, True when every aggregated
                gradient of the step was finite.

        Returns:
            Boolean scalar tensor: True when the step's gradients should be
            applied.
        """
        raise NotImplementedError

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale changes during training and steps may be skipped."""
        return False

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, as `from_config` takes it."""
        raise NotImplementedError

    @classmethod
    def from_config(cls: type[_T], config: dict[str, Any]) -> _T:
        """Restores a loss scale from `get_config()`'s output."""
        _config.check_config(cls, config)
        return cls(**config)

    def __repr__(self):
        arguments = ", ".join(
            f"{k}={v!r}" for k, v in self.get_config().items()
        )
        return f"{type(self).__name__}({arguments})"


def _check_number(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a number. "
            f"Received: {name}={value!r} (of type {type(value).__name__})"
        )
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite. Received: {name}={value!r}")
    return value


@keras.saving.register_keras_serializable(package="keras_mp")
class FixedLossScale(LossScale):
    """Loss scale that never changes.

    A fixed scale never skips a step: gradients are applied unconditionally
    (RFC 293), so a scale too large for the model gives inf/NaN weights rather
    than a silently stalled run. Prefer `DynamicLossScale` unless a known good
    value is at hand.

    Args:
        loss_scale_value: The scale, a number >= 1.

    Example:

    >>> scale = keras_mp.FixedLossScale(128)
    >>> float(scale())
    128.0
    """

    def __init__(self, loss_scale_value: float) -> None:
        super().__init__()
        _check_number("loss_scale_value", loss_scale_value)
        if loss_scale_value < 1:
            raise ValueError(
                "`loss_scale_value` must be at least 1: a fixed scale below 1 "
                "makes underflow worse. Received: "
                f"loss_scale_value={loss_scale_value!r}. For a loss that "
                "overflows float16 itself, use "
                "DynamicLossScale(min_loss_scale=...) instead."
            )
        self._loss_scale_value = float(loss_scale_value)

    @property
    def loss_scale_value(self) -> float:
        """The fixed scale, a Python float (`self()` is it as a tensor)."""
        return self._loss_scale_value

    def __call__(self) -> Any:
        # A `constant`: on PyTorch no copy from the host at each step.
        value = constant(self._loss_scale_value, "float32")
        return ops.convert_to_tensor(value, dtype="float32")

    def update(self, is_finite: Any) -> Any:
        return ops.convert_to_tensor(constant(True, "bool"))

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, as `from_config` takes it."""
        return {"loss_scale_value": self._loss_scale_value}


_ON_MIN_SCALE = ("warn", "raise", "ignore")
_FLOAT32_SMALLEST_NORMAL = 2.0**-126
_FLOAT32_MAX = (2.0 - 2.0**-23) * 2.0**127


@keras.saving.register_keras_serializable(package="keras_mp")
class DynamicLossScale(LossScale):
    """Loss scale that grows while gradients stay finite and shrinks on overflow.

    Scaling the loss keeps small float16 gradients from flushing to zero;
    the scale settles near the largest value that does not overflow.

    On a step with a non-finite gradient the scale becomes
    `max(scale / multiplier, min_loss_scale)`, `num_good_steps` resets and
    the step is skipped. (The scale is a float32 value and is divided as
    `scale * (1 / multiplier)`, the same float32 product eagerly and in a
    compiled step; with a power-of-two multiplier that is the exact
    quotient.) After `increment_period` finite steps in a row the
    counter resets and the scale is multiplied by `multiplier`, unless the
    result would be non-finite or above `max_loss_scale`, in which case it
    stays. With the default multiplier of 2, scales stay exact powers of two.

    Args:
        initial_loss_scale: Starting scale. Defaults to `2**15`.
        increment_period: Finite steps in a row before the scale grows.
            Defaults to `2000`.
        multiplier: Growth and shrink factor. Defaults to `2.0`.
        min_loss_scale: Floor of the scale. May be below 1 for losses that
            overflow float16 themselves. Defaults to `1.0`.
        max_loss_scale: Cap of the scale, or None for no cap other than
            float32's range. Defaults to `None`.
        hysteresis: How many non-finite steps in a row lower the scale (as
            in DeepSpeed and Megatron): with 2, one isolated overflow skips
            its step but keeps the scale. Every non-finite step is skipped
            whatever this is. Defaults to `1` (every overflow lowers it).
        on_min_scale: What happens when steps keep overflowing with the
            scale at `min_loss_scale`, where lowering it cannot help (the
            loss or the model overflows float16 by itself): `"warn"` warns
            once, naming the variables whose gradients overflowed most when
            the optimizer tracks them (`track_overflow=True`); `"raise"`
            raises `FloatingPointError`, which stops `fit`; `"ignore"` does
            nothing. It is checked where keras_mp reads the optimizer state
            anyway (`LossScaleLogger` in `fit`, by default once per epoch;
            `LossScaleOptimizer.check_min_scale()` in your own loop), never
            inside the step. Defaults to `"warn"`.

    Example:

    >>> scale = keras_mp.DynamicLossScale(initial_loss_scale=1024)
    >>> float(scale())
    1024.0
    """

    def __init__(
        self,
        initial_loss_scale: float = 2**15,
        increment_period: int = 2000,
        multiplier: float = 2.0,
        min_loss_scale: float = 1.0,
        max_loss_scale: float | None = None,
        hysteresis: int = 1,
        on_min_scale: str = "warn",
    ) -> None:
        super().__init__()
        _check_number("initial_loss_scale", initial_loss_scale)
        _check_number("multiplier", multiplier)
        _check_number("min_loss_scale", min_loss_scale)
        if max_loss_scale is not None:
            _check_number("max_loss_scale", max_loss_scale)
        if isinstance(increment_period, bool) or not isinstance(
            increment_period, numbers.Integral
        ):
            raise TypeError(
                "`increment_period` must be an integer. Received: "
                f"increment_period={increment_period!r}"
            )
        if increment_period < 1:
            raise ValueError(
                "`increment_period` must be at least 1. Received: "
                f"increment_period={increment_period!r}"
            )
        if isinstance(hysteresis, bool) or not isinstance(
            hysteresis, numbers.Integral
        ):
            raise TypeError(
                "`hysteresis` must be an integer. Received: "
                f"hysteresis={hysteresis!r}"
            )
        if hysteresis < 1:
            raise ValueError(
                "`hysteresis` must be at least 1 (1: every overflow lowers the "
                f"scale). Received: hysteresis={hysteresis!r}"
            )
        if on_min_scale not in _ON_MIN_SCALE:
            raise ValueError(
                f"`on_min_scale` must be one of {list(_ON_MIN_SCALE)}. "
                f"Received: on_min_scale={on_min_scale!r}"
            )
        if multiplier <= 1:
            raise ValueError(
                "`multiplier` must be greater than 1, or the scale could never "
                f"recover from an overflow. Received: multiplier={multiplier!r}"
            )
        if min_loss_scale <= 0:
            raise ValueError(
                "`min_loss_scale` must be positive. Received: "
                f"min_loss_scale={min_loss_scale!r}"
            )
        if min_loss_scale < _FLOAT32_SMALLEST_NORMAL:
            raise ValueError(
                "`min_loss_scale` must be at least 2**-126 (about 1.18e-38), "
                "float32's smallest normal number: the scale is a float32 "
                "value, and below that it rounds to 0 or to a subnormal that "
                "XLA flushes to 0, and a zero scale zeroes every gradient. "
                f"Received: min_loss_scale={min_loss_scale!r}"
            )
        if initial_loss_scale > _FLOAT32_MAX:
            raise ValueError(
                "`initial_loss_scale` must be at most float32's largest "
                "value (about 3.4e38): the scale is a float32 value, and "
                "above that it is inf. Received: "
                f"initial_loss_scale={initial_loss_scale!r}"
            )
        if initial_loss_scale < min_loss_scale:
            raise ValueError(
                "`initial_loss_scale` must be at least `min_loss_scale`. "
                f"Received: initial_loss_scale={initial_loss_scale!r}, "
                f"min_loss_scale={min_loss_scale!r}. Lower min_loss_scale or "
                "raise initial_loss_scale."
            )
        if max_loss_scale is not None and initial_loss_scale > max_loss_scale:
            raise ValueError(
                "`initial_loss_scale` must be at most `max_loss_scale`. "
                f"Received: initial_loss_scale={initial_loss_scale!r}, "
                f"max_loss_scale={max_loss_scale!r}. Raise max_loss_scale or "
                "lower initial_loss_scale."
            )
        self.initial_loss_scale: float = float(initial_loss_scale)
        self.increment_period: int = int(increment_period)
        self.multiplier: float = float(multiplier)
        self.min_loss_scale: float = float(min_loss_scale)
        self.max_loss_scale: float | None = (
            None if max_loss_scale is None else float(max_loss_scale)
        )
        self.hysteresis: int = int(hysteresis)
        self.on_min_scale: str = on_min_scale
        # State an importer carries over (`from_torch`, `from_deepspeed`):
        # the values the variables start from when `build` creates them.
        self._initial_num_good_steps = 0
        self._initial_overflows_in_a_row = 0

    def build(self) -> None:
        if self.built:
            return
        self._loss_scale = self._add_variable(
            "loss_scale", self.initial_loss_scale, "float32"
        )
        self._num_good_steps = self._add_variable(
            "num_good_steps", self._initial_num_good_steps, "int32"
        )
        # Only with hysteresis, so that the default checkpoint layout is the
        # one every earlier version wrote.
        self._overflows_in_a_row = None
        if self.hysteresis > 1:
            self._overflows_in_a_row = self._add_variable(
                "overflows_in_a_row", self._initial_overflows_in_a_row, "int32"
            )
        super().build()

    @property
    def loss_scale(self) -> keras.Variable:
        """Keras variable holding the current scale (float32)."""
        self.build()
        return self._loss_scale

    @property
    def num_good_steps(self) -> keras.Variable:
        """Keras variable counting finite steps since the last change."""
        self.build()
        return self._num_good_steps

    @property
    def is_dynamic(self) -> bool:
        return True

    def __call__(self) -> Any:
        if not self.built:
            return ops.convert_to_tensor(self.initial_loss_scale, "float32")
        # A copy: under tf.distribute `value` is a MirroredVariable, which
        # `convert_to_tensor` would pass through.
        return ops.copy(self._loss_scale.value)

    def update(self, is_finite: Any) -> Any:
        self.build()
        is_finite = ops.convert_to_tensor(is_finite, "bool")
        scale = ops.convert_to_tensor(self._loss_scale.value, "float32")
        good_steps = ops.convert_to_tensor(self._num_good_steps.value, "int32")

        good_steps = good_steps + 1
        # Python numbers as `constant`s (on PyTorch, no copy from the host).
        grow = ops.greater_equal(
            good_steps, constant(self.increment_period, "int32")
        )
        grown = scale * self.multiplier
        can_grow = ops.isfinite(grown)
        if self.max_loss_scale is not None:
            can_grow = ops.logical_and(
                can_grow,
                ops.less_equal(
                    grown, constant(float(self.max_loss_scale), "float32")
                ),
            )
        scale_if_finite = ops.where(
            ops.logical_and(grow, can_grow), grown, scale
        )
        good_if_finite = ops.where(grow, ops.zeros_like(good_steps), good_steps)
        # A product, not `scale / multiplier`: XLA turns a division by a
        # constant into this product inside a compiled step, so dividing
        # would give a different float32 (by one ulp, for a multiplier
        # that is not a power of two) eagerly and compiled.
        scale_if_not = ops.maximum(
            scale * (1.0 / self.multiplier),
            constant(float(self.min_loss_scale), "float32"),
        )
        if self._overflows_in_a_row is not None:
            overflows = (
                ops.convert_to_tensor(self._overflows_in_a_row.value, "int32")
                + 1
            )
            lower = ops.greater_equal(
                overflows, constant(self.hysteresis, "int32")
            )
            scale_if_not = ops.where(lower, scale_if_not, scale)
            self._overflows_in_a_row.assign(
                ops.where(
                    ops.logical_or(is_finite, lower),
                    ops.zeros_like(overflows),
                    overflows,
                )
            )

        self._loss_scale.assign(
            ops.where(is_finite, scale_if_finite, scale_if_not)
        )
        self._num_good_steps.assign(
            ops.where(is_finite, good_if_finite, ops.zeros_like(good_steps))
        )
        return is_finite

    def get_config(self) -> dict[str, Any]:
        """Every constructor argument, as `from_config` takes it."""
        return {
            "initial_loss_scale": self.initial_loss_scale,
            "increment_period": self.increment_period,
            "multiplier": self.multiplier,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
            "hysteresis": self.hysteresis,
            "on_min_scale": self.on_min_scale,
        }

    # Importers of other libraries' scaler state; their bodies and
    # docstrings (with the differences from torch's and DeepSpeed's
    # algorithms) are in `keras_mp/_scaler_import/`. Written out here so
    # that type checkers see their signatures.
    @classmethod
    def from_torch(
        cls,
        state_dict: Mapping[str, Any],
        *,
        min_loss_scale: float = 1.0,
        max_loss_scale: float | None = None,
        on_min_scale: str = "warn",
    ) -> DynamicLossScale:
        return _from_torch.from_torch(
            cls,
            state_dict,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            on_min_scale=on_min_scale,
        )

    @classmethod
    def from_deepspeed(
        cls,
        config: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
        *,
        max_loss_scale: float | None = None,
        on_min_scale: str = "warn",
    ) -> DynamicLossScale:
        return _from_deepspeed.from_deepspeed(
            cls,
            config,
            state,
            max_loss_scale=max_loss_scale,
            on_min_scale=on_min_scale,
        )

    from_torch.__func__.__doc__ = _from_torch.from_torch.__doc__
    from_deepspeed.__func__.__doc__ = _from_deepspeed.from_deepspeed.__doc__


# What `Policy(loss_scale=...)` and `LossScaleOptimizer(loss_scale=...)`
# take: a `LossScale`, `"dynamic"`, `"auto"` (a policy's default), a
# number, a config dict or None.
LossScaleLike = LossScale | str | float | dict[str, Any] | None


def get(identifier: LossScaleLike) -> LossScale | None:
    """Returns a `LossScale` for an identifier.

    Args:
        identifier: None, `"dynamic"`, a number (a `FixedLossScale`), a
            `LossScale`, or a config dict as `keras.saving` writes it.

    Returns:
        A `LossScale`, or None.
    """
    if identifier is None or isinstance(identifier, LossScale):
        return identifier
    if identifier == "dynamic":
        return DynamicLossScale()
    if isinstance(identifier, numbers.Real) and not isinstance(
        identifier, bool
    ):
        return FixedLossScale(identifier)
    if isinstance(identifier, dict):
        if "class_name" not in identifier:
            raise ValueError(
                "A loss scale config dict needs a 'class_name' key, as "
                "`keras.saving.serialize_keras_object` writes it. Received: "
                f"loss_scale={identifier!r}"
            )
        try:
            loss_scale = keras.saving.deserialize_keras_object(identifier)
        except (TypeError, ValueError) as error:
            raise ValueError(
                "Expected a loss scale config, such as "
                "`keras.saving.serialize_keras_object(keras_mp."
                "DynamicLossScale())` returns; its 'class_name' is "
                "'DynamicLossScale' or 'FixedLossScale'. Received: "
                f"loss_scale={identifier!r}"
            ) from error
        if not isinstance(loss_scale, LossScale):
            raise ValueError(
                "Expected a loss scale config; this one describes a "
                f"{type(loss_scale).__name__}. "
                f"Received: loss_scale={identifier!r}"
            )
        return loss_scale
    if isinstance(identifier, str):
        raise ValueError(
            "Unknown loss scale name. Expected 'dynamic' (or 'auto' for a "
            f"Policy). Received: loss_scale={identifier!r}"
        )
    raise TypeError(
        "`loss_scale` must be None, 'dynamic', a number, a keras_mp.LossScale "
        "or a loss scale config dict. "
        f"Received: loss_scale={identifier!r} "
        f"(of type {type(identifier).__name__})"
    )
