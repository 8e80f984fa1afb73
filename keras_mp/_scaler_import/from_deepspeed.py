"""`DynamicLossScale.from_deepspeed`: DeepSpeed's fp16 block and state.

The body and docstring of the classmethod (the class is passed in as `cls`),
and how DeepSpeed's algorithm differs from keras_mp's.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any
from typing import TypeVar

from keras_mp._scaler_import.checks import _check_bool
from keras_mp._scaler_import.checks import _check_integer
from keras_mp._scaler_import.checks import _check_positive
from keras_mp._scaler_import.checks import _require_keys
from keras_mp._scaler_import.checks import _short

# DynamicLossScale, which passes itself as `cls`.
_T = TypeVar("_T")

_DEEPSPEED_FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


def from_deepspeed(
    cls: type[_T],
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None = None,
    *,
    max_loss_scale: float | None = None,
    on_min_scale: str = "warn",
) -> _T:
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
