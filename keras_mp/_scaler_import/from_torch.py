"""`DynamicLossScale.from_torch`: GradScaler, Lightning and apex state.

The body and docstring of the classmethod (the class is passed in as `cls`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from typing import TypeVar

from keras_mp._scaler_import.checks import _check_integer
from keras_mp._scaler_import.checks import _check_positive
from keras_mp._scaler_import.checks import _check_tracker
from keras_mp._scaler_import.checks import _require_keys

# DynamicLossScale, which passes itself as `cls`.
_T = TypeVar("_T")


def from_torch(
    cls: type[_T],
    state_dict: Mapping[str, Any],
    *,
    min_loss_scale: float = 1.0,
    max_loss_scale: float | None = None,
    on_min_scale: str = "warn",
) -> _T:
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
