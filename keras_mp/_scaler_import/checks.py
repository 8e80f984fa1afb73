"""Checks shared by the loss scaler importers: plain Python values only.

Imports nothing from keras_mp.
"""

import math
import numbers


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


def _check_bool(name, value, source):
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` in the {source} must be a bool. Received: "
            f"{name}={value!r}"
        )
    return value
