"""Loss scales: how much to multiply the loss by before taking gradients.

Imports from keras_mp only `_config`; nothing above its floor (see
ARCHITECTURE.md).
"""

import math
import numbers

import keras
from keras import ops

from keras_mp import _config


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

    def __init__(self):
        self._variables = []
        self.built = False

    def build(self):
        """Creates the state variables. Safe to call more than once."""
        self.built = True

    @property
    def variables(self):
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

    def __call__(self):
        """Returns the current loss scale as a float32 scalar tensor."""
        raise NotImplementedError

    def update(self, is_finite):
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
    def is_dynamic(self):
        """Whether the scale changes during training and steps may be skipped."""
        return False

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config):
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

    def __init__(self, loss_scale_value):
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
    def loss_scale_value(self):
        """The fixed scale, a Python float (`self()` is it as a tensor)."""
        return self._loss_scale_value

    def __call__(self):
        return ops.convert_to_tensor(self._loss_scale_value, dtype="float32")

    def update(self, is_finite):
        return ops.convert_to_tensor(True)

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        return {"loss_scale_value": self._loss_scale_value}


_ON_MIN_SCALE = ("warn", "raise", "ignore")


@keras.saving.register_keras_serializable(package="keras_mp")
class DynamicLossScale(LossScale):
    """Loss scale that grows while gradients stay finite and shrinks on overflow.

    Scaling the loss keeps small float16 gradients from flushing to zero;
    the scale settles near the largest value that does not overflow.

    On a step with a non-finite gradient the scale becomes
    `max(scale / multiplier, min_loss_scale)`, `num_good_steps` resets and
    the step is skipped. After `increment_period` finite steps in a row the
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
        initial_loss_scale=2**15,
        increment_period=2000,
        multiplier=2.0,
        min_loss_scale=1.0,
        max_loss_scale=None,
        hysteresis=1,
        on_min_scale="warn",
    ):
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
        self.initial_loss_scale = float(initial_loss_scale)
        self.increment_period = int(increment_period)
        self.multiplier = float(multiplier)
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = (
            None if max_loss_scale is None else float(max_loss_scale)
        )
        self.hysteresis = int(hysteresis)
        self.on_min_scale = on_min_scale
        # State an importer carries over (`from_torch`, `from_deepspeed`):
        # the values the variables start from when `build` creates them.
        self._initial_num_good_steps = 0
        self._initial_overflows_in_a_row = 0

    def build(self):
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
    def loss_scale(self):
        """Keras variable holding the current scale (float32)."""
        self.build()
        return self._loss_scale

    @property
    def num_good_steps(self):
        """Keras variable counting finite steps since the last change."""
        self.build()
        return self._num_good_steps

    @property
    def is_dynamic(self):
        return True

    def __call__(self):
        if not self.built:
            return ops.convert_to_tensor(self.initial_loss_scale, "float32")
        # A copy: under tf.distribute `value` is a MirroredVariable, which
        # `convert_to_tensor` would pass through.
        return ops.copy(self._loss_scale.value)

    def update(self, is_finite):
        self.build()
        is_finite = ops.convert_to_tensor(is_finite, "bool")
        scale = ops.convert_to_tensor(self._loss_scale.value, "float32")
        good_steps = ops.convert_to_tensor(self._num_good_steps.value, "int32")

        good_steps = good_steps + 1
        grow = ops.greater_equal(good_steps, self.increment_period)
        grown = scale * self.multiplier
        can_grow = ops.isfinite(grown)
        if self.max_loss_scale is not None:
            can_grow = ops.logical_and(
                can_grow, ops.less_equal(grown, self.max_loss_scale)
            )
        scale_if_finite = ops.where(
            ops.logical_and(grow, can_grow), grown, scale
        )
        good_if_finite = ops.where(grow, ops.zeros_like(good_steps), good_steps)
        scale_if_not = ops.maximum(scale / self.multiplier, self.min_loss_scale)
        if self._overflows_in_a_row is not None:
            overflows = (
                ops.convert_to_tensor(self._overflows_in_a_row.value, "int32")
                + 1
            )
            lower = ops.greater_equal(overflows, self.hysteresis)
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

    def get_config(self):
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

    @classmethod
    def from_torch(
        cls,
        state_dict,
        *,
        min_loss_scale=1.0,
        max_loss_scale=None,
        on_min_scale="warn",
    ):
        """Continues a PyTorch loss scaler's run where it stopped.

        Takes any of:

        - `torch.amp.GradScaler.state_dict()` (also
          `torch.cuda.amp.GradScaler`'s, and Accelerate's `scaler.pt`):
          `scale`, `growth_factor`, `backoff_factor`, `growth_interval`,
          `_growth_tracker`;
        - a whole PyTorch Lightning checkpoint, which keeps that dict under
          its precision plugin's class name (`"MixedPrecision"`,
          `"MixedPrecisionPlugin"`, or 1.x's `"native_amp_scaling_state"`);
        - apex amp's `amp.state_dict()`: `{"loss_scaler0": {"loss_scale",
          "unskipped"}}`. apex does not save its window, factor and cap, so
          its defaults are used: `increment_period=2000`, `multiplier=2`,
          and `max_loss_scale=2**24` unless you pass one.

        GradScaler and apex update the scale by keras_mp's rule: the scale
        becomes `scale * growth_factor` at the `growth_interval`-th finite
        step in a row, and `_growth_tracker` (apex: `unskipped`) counts the
        finite steps so far, as `num_good_steps` does. So `scale` becomes
        `loss_scale`, `_growth_tracker` becomes `num_good_steps`,
        `growth_interval` becomes `increment_period` and `growth_factor`
        becomes `multiplier`, and the scale sequence continues step for step
        (a tracker of `growth_interval - 1` grows at the next finite step).
        One difference remains: GradScaler has no floor, keras_mp stops at
        `min_loss_scale`. keras_mp has one factor for growth and backoff, so
        `backoff_factor` must be `1 / growth_factor` (0.5 for the default
        2.0); anything else raises rather than being approximated.

        The state is in place when the variables are created (`build()`,
        which the optimizer calls): give the result to
        `keras_mp.LossScaleOptimizer(optimizer, loss_scale=...)`. A
        `keras_mp.Policy`'s loss scale is copied from its config at
        `compile`, which keeps the scale but restarts the count at 0.
        Bad input raises before anything is created.

        Args:
            state_dict: One of the dicts above, with Python numbers (as
                `torch.load` gives them).
            min_loss_scale: Floor of the scale (GradScaler has none). Must
                not be above the saved scale. Defaults to `1.0`.
            max_loss_scale: Cap of the scale, or None. Defaults to `None`
                (`2**24` for apex's dict).
            on_min_scale: As in `DynamicLossScale`. Defaults to `"warn"`.

        Returns:
            A `DynamicLossScale`.

        Example:

        >>> state = {"scale": 4096.0, "growth_factor": 2.0,
        ...          "backoff_factor": 0.5, "growth_interval": 100,
        ...          "_growth_tracker": 99}
        >>> scale = keras_mp.DynamicLossScale.from_torch(state)
        >>> scale.increment_period, int(scale.num_good_steps.numpy())
        (100, 99)
        >>> _ = scale.update(True)  # the 100th finite step in a row
        >>> float(scale())
        8192.0
        """
        state, apex = _grad_scaler_state(state_dict)
        if apex and max_loss_scale is None:
            max_loss_scale = _APEX_MAX_LOSS_SCALE
        scale = state["scale"]
        if scale < min_loss_scale:
            raise ValueError(
                "The saved scale is below `min_loss_scale` (GradScaler has no "
                "floor, keras_mp's scale stops at min_loss_scale). Received: "
                f"scale={scale!r}, min_loss_scale={min_loss_scale!r}. Pass "
                f"from_torch(..., min_loss_scale={scale!r}) or lower."
            )
        loss_scale = cls(
            initial_loss_scale=scale,
            increment_period=state["growth_interval"],
            multiplier=state["growth_factor"],
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            on_min_scale=on_min_scale,
        )
        loss_scale._initial_num_good_steps = state["_growth_tracker"]
        return loss_scale

    @classmethod
    def from_deepspeed(
        cls, config, state=None, *, max_loss_scale=None, on_min_scale="warn"
    ):
        """A dynamic loss scale with DeepSpeed's fp16 settings and state.

        `config` is a DeepSpeed config (ds_config.json as a dict) or its
        `"fp16"` block. Keys, with DeepSpeed's defaults where one is
        missing: `initial_scale_power` (16: the scale starts at `2**16`),
        `loss_scale_window` (1000) becomes `increment_period`, `hysteresis`
        (2), `consecutive_hysteresis` (False) and `min_loss_scale` (1).
        `multiplier` is 2, as in DeepSpeed. `loss_scale` must be 0 (dynamic):
        a positive value is a static scale, for which the error names
        `keras_mp.FixedLossScale(value)`. `"enabled"` and `"auto_cast"` are
        accepted and not used; other keys raise.

        `state`, optional, is the scaler's state from a DeepSpeed
        checkpoint, as a dict: `cur_scale`, `cur_iter`,
        `last_overflow_iter`, and `cur_hysteresis` when it has one (ZeRO's
        pickled `DynamicLossScaler`: `vars(scaler)`); `scale_window`,
        `scale_factor`, `min_scale`, `delayed_shift`,
        `consecutive_hysteresis`, `dynamic` and `dynamic_loss_scale`, where
        present, must agree with `config`. The count of finite steps becomes
        `(cur_iter - last_overflow_iter - 1) % loss_scale_window`.

        How the algorithms compare, step for step:

        - Growth. ZeRO (stages 1 to 3) uses `DynamicLossScaler`, which grows
          at the `loss_scale_window`-th finite step after the start or an
          overflow, then every window, as keras_mp does. Without ZeRO,
          `FP16_Optimizer` and `FP16_UnfusedOptimizer` do not count the
          first finite step after the start or after an overflow: they
          grow at the `window + 1`-th, then every window, so keras_mp
          grows one step earlier each time. They also ignore `hysteresis`.
        - Hysteresis, with `hysteresis=2` (DeepSpeed's default): keras_mp
          lowers the scale at the 2nd overflow in a row, then again at the
          4th, 6th, ... (its count restarts after each lowering). DeepSpeed
          with `consecutive_hysteresis=True` lowers at the 2nd and at every
          further overflow in a row. With `consecutive_hysteresis=False`
          DeepSpeed forgives `hysteresis - 1` overflows per growth of the
          scale, in a row or not: after an isolated overflow, the next one
          lowers the scale even many finite steps later, while keras_mp
          forgives every isolated overflow. Both settings give keras_mp's
          `hysteresis` (overflows in a row).
        - At `min_loss_scale` DeepSpeed raises inside the step; keras_mp
          follows `on_min_scale` (`"raise"` stops `fit` at the next check).

        As with `from_torch`, the state is in place when `build()` creates
        the variables; give the result to `keras_mp.LossScaleOptimizer`.
        Bad input raises before anything is created.

        Args:
            config: A DeepSpeed config dict, or its `"fp16"` block.
            state: DeepSpeed's scaler state as a dict, or None to start
                fresh. Defaults to `None`.
            max_loss_scale: Cap of the scale (DeepSpeed has none). Defaults
                to `None`.
            on_min_scale: As in `DynamicLossScale`. Defaults to `"warn"`.

        Returns:
            A `DynamicLossScale`.

        Example:

        >>> config = {"fp16": {"enabled": True, "loss_scale": 0,
        ...                    "initial_scale_power": 12,
        ...                    "loss_scale_window": 500, "hysteresis": 2}}
        >>> scale = keras_mp.DynamicLossScale.from_deepspeed(config)
        >>> float(scale()), scale.increment_period, scale.hysteresis
        (4096.0, 500, 2)
        >>> state = {"cur_scale": 1024.0, "cur_iter": 710,
        ...          "last_overflow_iter": 200, "cur_hysteresis": 2}
        >>> scale = keras_mp.DynamicLossScale.from_deepspeed(config, state)
        >>> float(scale()), int(scale.num_good_steps.numpy())
        (1024.0, 9)
        """
        block = _deepspeed_fp16_block(config)
        window = block["loss_scale_window"]
        hysteresis = block["hysteresis"]
        initial_loss_scale = 2.0 ** block["initial_scale_power"]
        multiplier = 2.0
        num_good_steps = overflows_in_a_row = 0
        if state is not None:
            state = _deepspeed_scaler_state(state, block)
            initial_loss_scale = state["cur_scale"]
            multiplier = state.get("scale_factor", multiplier)
            since_overflow = state["cur_iter"] - state["last_overflow_iter"]
            num_good_steps = (since_overflow - 1) % window
            # DeepSpeed's countdown of forgiven overflows; keras_mp counts
            # overflows in a row, so only an overflow on the last step
            # carries over.
            if since_overflow == 1 and hysteresis > 1:
                cur_hysteresis = state.get("cur_hysteresis", hysteresis)
                overflows_in_a_row = hysteresis - cur_hysteresis
        if initial_loss_scale < block["min_loss_scale"]:
            raise ValueError(
                "The loss scale is below DeepSpeed's `min_loss_scale`. "
                f"Received: scale={initial_loss_scale!r}, "
                f"min_loss_scale={block['min_loss_scale']!r}. Lower "
                "min_loss_scale in the fp16 block to the saved scale."
            )
        loss_scale = cls(
            initial_loss_scale=initial_loss_scale,
            increment_period=window,
            multiplier=multiplier,
            min_loss_scale=block["min_loss_scale"],
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            on_min_scale=on_min_scale,
        )
        loss_scale._initial_num_good_steps = num_good_steps
        loss_scale._initial_overflows_in_a_row = overflows_in_a_row
        return loss_scale


# Importers of other libraries' loss scaler state: `from_torch` and
# `from_deepspeed` above. Each returns plain, validated Python values.

_GRAD_SCALER_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
)
# Where PyTorch Lightning keeps the GradScaler state in its checkpoints: the
# precision plugin's class `__qualname__` (2.x, then 1.x), or 1.x's key.
_LIGHTNING_SCALER_KEYS = (
    "MixedPrecision",
    "MixedPrecisionPlugin",
    "native_amp_scaling_state",
)
# apex amp's LossScaler defaults, which `amp.state_dict()` does not save.
_APEX_INCREMENT_PERIOD = 2000
_APEX_MAX_LOSS_SCALE = 2.0**24


def _check_integer(name, value, minimum, source):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` in the {source} must be an integer. Received: "
            f"{name}={value!r} (of type {type(value).__name__}). Convert "
            "tensors with `.item()`."
        )
    if value < minimum:
        raise ValueError(
            f"`{name}` in the {source} must be at least {minimum}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def _check_positive(name, value, source):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` in the {source} must be a number. Received: "
            f"{name}={value!r} (of type {type(value).__name__}). Convert "
            "tensors with `.item()`."
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` in the {source} must be finite and positive. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def _require_keys(mapping, keys, source, fix):
    missing = [key for key in keys if key not in mapping]
    if missing:
        raise ValueError(
            f"The {source} lacks the keys {missing}; expected "
            f"{list(keys)}. Received: {_short(mapping)}. {fix}"
        )


def _short(mapping):
    text = repr(mapping)
    return text if len(text) <= 300 else text[:300] + "...}"


def _grad_scaler_state(state_dict):
    """Validated GradScaler state from the formats `from_torch` takes.

    Returns the state, with apex's translated to GradScaler's keys, and
    whether it came from apex.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(
            "`state_dict` must be a dict, such as "
            "`torch.amp.GradScaler.state_dict()` returns. Received: "
            f"state_dict of type {type(state_dict).__name__}"
        )
    if not state_dict:
        raise ValueError(
            "The GradScaler state dict is empty: that is what a disabled "
            "scaler saves (`GradScaler(enabled=False)`, e.g. for bfloat16, "
            "which needs no loss scale). Received: state_dict={}. Train "
            "without a loss scale (a bfloat16 policy), or start a fresh "
            "`keras_mp.DynamicLossScale()`."
        )
    lightning = [key for key in _LIGHTNING_SCALER_KEYS if key in state_dict]
    if lightning:
        return _grad_scaler_state(state_dict[lightning[0]])
    apex = [key for key in state_dict if str(key).startswith("loss_scaler")]
    if apex and not any(key in state_dict for key in _GRAD_SCALER_KEYS):
        if len(apex) > 1:
            raise ValueError(
                "This apex amp state has one loss scaler per loss; a "
                "keras_mp loss scale belongs to one optimizer. Received: "
                f"the keys {sorted(apex)}. Import each on its own: "
                "`from_torch({'loss_scaler0': state['loss_scaler1']})`."
            )
        scaler = state_dict[apex[0]]
        source = "apex amp loss scaler state"
        if not isinstance(scaler, dict):
            raise TypeError(
                f"The {source} must be a dict with 'loss_scale' and "
                f"'unskipped'. Received: {apex[0]}={scaler!r}"
            )
        _require_keys(
            scaler,
            ("loss_scale", "unskipped"),
            source,
            "Pass `amp.state_dict()` as apex saved it.",
        )
        return {
            "scale": _check_positive(
                "loss_scale", scaler["loss_scale"], source
            ),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": _APEX_INCREMENT_PERIOD,
            "_growth_tracker": _check_tracker(
                "unskipped", scaler["unskipped"], _APEX_INCREMENT_PERIOD, source
            ),
        }, True
    source = "GradScaler state dict"
    _require_keys(
        state_dict,
        _GRAD_SCALER_KEYS,
        source,
        "Pass `torch.amp.GradScaler.state_dict()` (a PyTorch Lightning "
        f"checkpoint keeps it under one of {list(_LIGHTNING_SCALER_KEYS)}; "
        "apex amp's under 'loss_scaler0').",
    )
    state = {
        "scale": _check_positive("scale", state_dict["scale"], source),
        "growth_factor": _check_positive(
            "growth_factor", state_dict["growth_factor"], source
        ),
        "backoff_factor": _check_positive(
            "backoff_factor", state_dict["backoff_factor"], source
        ),
        "growth_interval": _check_integer(
            "growth_interval", state_dict["growth_interval"], 1, source
        ),
    }
    state["_growth_tracker"] = _check_tracker(
        "_growth_tracker",
        state_dict["_growth_tracker"],
        state["growth_interval"],
        source,
    )
    growth, backoff = state["growth_factor"], state["backoff_factor"]
    if growth <= 1:
        raise ValueError(
            "`growth_factor` must be greater than 1. Received: "
            f"growth_factor={growth!r}. keras_mp's scale needs a factor "
            "that grows it; continue with a FixedLossScale if it never grew."
        )
    if not math.isclose(backoff, 1.0 / growth, rel_tol=1e-12):
        raise ValueError(
            "keras_mp's DynamicLossScale has one `multiplier` for growth "
            "and backoff, so `backoff_factor` must be `1 / growth_factor` "
            f"= {1.0 / growth!r}. Received: growth_factor={growth!r}, "
            f"backoff_factor={backoff!r}. Construct "
            "`keras_mp.DynamicLossScale(initial_loss_scale=..., "
            "multiplier=...)` with the one factor you want; the sequence of "
            "scales will then differ from torch's after the first overflow."
        )
    return state, False


def _check_tracker(name, value, period, source):
    value = _check_integer(name, value, 0, source)
    if value >= period:
        raise ValueError(
            f"`{name}` in the {source} counts finite steps since the scale "
            f"last changed and stays below the growth interval ({period}). "
            f"Received: {name}={value!r}. Pass the state as the scaler "
            "saved it."
        )
    return value


_DEEPSPEED_FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
# Keys of DeepSpeed's fp16 block that do not concern the loss scale.
_DEEPSPEED_FP16_OTHER_KEYS = (
    "enabled",
    "auto_cast",
    "fp16_master_weights_and_grads",
)


def _deepspeed_fp16_block(config):
    """The validated loss scale settings of a DeepSpeed config."""
    if not isinstance(config, dict):
        raise TypeError(
            "`config` must be a DeepSpeed config dict or its 'fp16' block. "
            f"Received: config of type {type(config).__name__}"
        )
    if "fp16" in config:
        block = config["fp16"]
        if not isinstance(block, dict):
            raise TypeError(
                "The 'fp16' block of a DeepSpeed config must be a dict. "
                f"Received: fp16={block!r}"
            )
    elif any(key in config for key in _DEEPSPEED_FP16_DEFAULTS):
        block = config
    else:
        why = (
            "bfloat16 training needs no loss scale"
            if "bf16" in config or "bfloat16" in config
            else "without one DeepSpeed scales no loss"
        )
        raise ValueError(
            "Expected a DeepSpeed config with an 'fp16' block, or the block "
            f"itself; {why}. Received: config={_short(config)}. Train "
            "without a loss scale, or pass the fp16 block."
        )
    if block.get("enabled", True) is not True:
        raise ValueError(
            "This DeepSpeed fp16 block is not enabled, so DeepSpeed scales no "
            f"loss. Received: enabled={block.get('enabled')!r}. Train "
            "without a loss scale, or set 'enabled': true."
        )
    unknown = sorted(
        str(key)
        for key in block
        if key not in _DEEPSPEED_FP16_DEFAULTS
        and key not in _DEEPSPEED_FP16_OTHER_KEYS
    )
    if unknown:
        raise ValueError(
            f"Unknown keys in the DeepSpeed fp16 block: {unknown}. Expected "
            f"some of {list(_DEEPSPEED_FP16_DEFAULTS)} (and "
            f"{list(_DEEPSPEED_FP16_OTHER_KEYS)}). Received: "
            f"{_short(block)}. Check their spelling."
        )
    settings = {**_DEEPSPEED_FP16_DEFAULTS, **block}
    source = "DeepSpeed fp16 block"
    static = settings["loss_scale"]
    if isinstance(static, bool) or not isinstance(static, numbers.Real):
        raise TypeError(
            f"`loss_scale` in the {source} must be a number (0: dynamic). "
            f"Received: loss_scale={static!r}. Pass the config with "
            "'auto' values already filled in."
        )
    if static != 0:
        raise ValueError(
            "This DeepSpeed fp16 block sets a static loss scale (loss_scale "
            f"> 0), not a dynamic one. Received: loss_scale={static!r}. Use "
            f"`keras_mp.FixedLossScale({static!r})` (per RFC 293 it never "
            "skips a step; DeepSpeed skips overflowing ones), or set "
            "'loss_scale': 0 for a dynamic scale."
        )
    return {
        "initial_scale_power": _check_integer(
            "initial_scale_power",
            settings["initial_scale_power"],
            -126,
            source,
        ),
        "loss_scale_window": _check_integer(
            "loss_scale_window", settings["loss_scale_window"], 1, source
        ),
        "hysteresis": _check_integer(
            "hysteresis", settings["hysteresis"], 1, source
        ),
        "consecutive_hysteresis": _check_bool(
            "consecutive_hysteresis", settings["consecutive_hysteresis"], source
        ),
        "min_loss_scale": _check_positive(
            "min_loss_scale", settings["min_loss_scale"], source
        ),
    }


def _check_bool(name, value, source):
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` in the {source} must be a bool. Received: "
            f"{name}={value!r}"
        )
    return value


def _deepspeed_scaler_state(state, block):
    """Validated DeepSpeed scaler state that agrees with `block`."""
    source = "DeepSpeed scaler state"
    if not isinstance(state, dict):
        raise TypeError(
            f"`state` must be a dict, the {source} (ZeRO's pickled "
            "DynamicLossScaler as `vars(scaler)`, or FP16_Optimizer's "
            "state_dict). Received: state of type "
            f"{type(state).__name__}"
        )
    _require_keys(
        state,
        ("cur_scale", "cur_iter", "last_overflow_iter"),
        source,
        "Pass the scaler's attributes as DeepSpeed saved them.",
    )
    for key in ("dynamic", "dynamic_loss_scale"):
        if key in state and state[key] is not True:
            raise ValueError(
                f"This {source} is of a static scaler. Received: "
                f"{key}={state[key]!r}. Use "
                f"`keras_mp.FixedLossScale({state['cur_scale']!r})`."
            )
    checked = {
        "cur_scale": _check_positive("cur_scale", state["cur_scale"], source),
        "cur_iter": _check_integer("cur_iter", state["cur_iter"], 0, source),
    }
    checked["last_overflow_iter"] = _check_integer(
        "last_overflow_iter", state["last_overflow_iter"], -1, source
    )
    if checked["last_overflow_iter"] >= checked["cur_iter"]:
        raise ValueError(
            f"`last_overflow_iter` in the {source} must be below `cur_iter` "
            f"(or -1). Received: cur_iter={checked['cur_iter']!r}, "
            f"last_overflow_iter={checked['last_overflow_iter']!r}. Pass "
            "the state as DeepSpeed saved it."
        )
    if "cur_hysteresis" in state:
        checked["cur_hysteresis"] = _check_integer(
            "cur_hysteresis", state["cur_hysteresis"], 1, source
        )
        if checked["cur_hysteresis"] > block["hysteresis"]:
            raise ValueError(
                f"`cur_hysteresis` in the {source} counts down from the "
                "config's `hysteresis`. Received: "
                f"cur_hysteresis={checked['cur_hysteresis']!r}, "
                f"hysteresis={block['hysteresis']!r}. Pass the config the "
                "run used."
            )
    if "scale_factor" in state:
        checked["scale_factor"] = _check_positive(
            "scale_factor", state["scale_factor"], source
        )
    agreements = (
        ("scale_window", "loss_scale_window"),
        ("delayed_shift", "hysteresis"),
        ("min_scale", "min_loss_scale"),
        ("consecutive_hysteresis", "consecutive_hysteresis"),
    )
    for state_key, config_key in agreements:
        if state_key in state and state[state_key] != block[config_key]:
            raise ValueError(
                f"The {source} was saved with another config: its "
                f"`{state_key}` must equal the fp16 block's `{config_key}`. "
                f"Received: {state_key}={state[state_key]!r}, "
                f"{config_key}={block[config_key]!r}. Pass the config the "
                "run used."
            )
    return checked


def get(identifier):
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
