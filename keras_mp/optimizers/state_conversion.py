"""Checkpoints converted between the state precision settings of optimizers.

`StateConversionMixin`, a base of `StatePrecisionMixin`: a checkpoint saved
with other settings loads (`checkpointing.py` asks): the seed state of
stochastic rounding and the masters, saved last, are kept or dropped, and
the inner optimizer's slots are converted where one side holds float8
state (codes and block scales, `state_formats.Float8BlockState`) and the
other not. Each warns.
"""

import warnings

import numpy as np

from keras_mp.optimizers import float8_state
from keras_mp.optimizers import state_formats


class StateConversionMixin:
    """Checkpoint values matched to a wrapper's state precision.

    Relies on the wrapper's `_state_precision_variables` and `_state_slots`
    (set by `StatePrecisionMixin`) and `name`.
    """

    def _matching_state_precision(self, variables, values):
        """The wrapper variables and checkpoint values to assign, when the
        checkpoint was written with other state precision settings.

        The seed state of stochastic rounding and the masters come last.
        A checkpoint without them (saved without stochastic rounding or
        master weights) leaves them as they are: the masters start again
        from the variables at the next step. A checkpoint with them, loaded
        where they do not exist, has its trailing values dropped. Both warn.
        """
        extra = len(self._state_precision_variables)
        if len(values) == len(variables) or not (
            extra or _saved_state_precision(values[len(variables) :])
        ):
            return variables, values
        if extra and len(values) == len(variables) - extra:
            warnings.warn(
                f"The checkpoint loaded into optimizer {self.name!r} holds no "
                "stochastic rounding seed or master weights: they keep their "
                "current values (masters follow the variables at the next "
                "step).",
                stacklevel=5,
            )
            return variables[: len(values)], values
        if not extra and len(values) > len(variables):
            warnings.warn(
                f"Dropped {len(values) - len(variables)} value(s) of the "
                f"checkpoint loaded into optimizer {self.name!r}: the "
                "stochastic rounding seed and master weights of an optimizer "
                "saved with state_dtype/master_weights, which this one does "
                "not use.",
                stacklevel=5,
            )
            return variables, values[: len(variables)]
        return variables, values

    def _matching_inner_state(self, variables, values):
        """The inner optimizer's checkpoint `values` for its `variables`,
        converted where one side has float8 state and the other not.

        float8 state saves two values per slot (uint8 codes, then float32
        block scales) where other state saves one: a float32, bfloat16 or
        float16 slot is quantized (to nearest) into codes and scales, codes
        and scales are decoded into a float32 value (which
        `checkpointing.py` then converts to a 16-bit slot's dtype). Warns,
        naming the conversion. Values that fit neither layout are returned
        as they are (the caller reports the mismatch).
        """
        values = [np.asarray(v) for v in values]
        slots = self._state_slots
        float8 = state_formats.Float8BlockState(stochastic_rounding=False)
        if slots is not None and slots.format.name == "float8":
            # The stored variables after each slot's first (its scales).
            companions = {
                id(companion)
                for variable in variables
                for companion in (slots.stored(variable) or [])[1:]
            }
            if not companions or len(values) != len(variables) - len(
                companions
            ):
                return values
            converted, remaining = [], iter(values)
            for variable in variables:
                if id(variable) in companions:
                    continue
                value = next(remaining)
                name = slots.slot_name(variable)
                if name is None:
                    converted.append(value)
                    continue
                if not np.issubdtype(value.dtype, np.floating) and (
                    value.dtype.name != "bfloat16"
                ):
                    return values
                value = value.astype(np.float32)
                if float8_state.ADAM_SLOTS[name]:
                    value = np.sqrt(value)
                converted += float8.encode_numpy(value)
            source = sorted({str(v.dtype) for v in values if v.ndim})
            what, conversion = len(companions), f"{'/'.join(source)} to float8"
        else:
            codes = sum(v.dtype == np.uint8 for v in values)
            if not codes or len(values) != len(variables) + codes:
                return values
            converted, index = [], 0
            for variable in variables:
                value = values[index]
                index += 1
                if value.dtype == np.uint8:
                    value = float8.decode_numpy([value, values[index]])
                    index += 1
                    if float8_state.is_second_moment(variable.path):
                        value = value * value
                converted.append(value)
            what, conversion = codes, "float8 to float32"
        warnings.warn(
            f"Converted {what} optimizer slot(s) from {conversion} while "
            f"loading the checkpoint of optimizer {self.name!r}: it was "
            "saved with another `state_dtype` "
            + (
                "(float8 codes and block scales are written from the values, "
                "rounded to nearest)."
                if conversion.endswith("to float8")
                else "(float8 codes and block scales decoded exactly)."
            ),
            stacklevel=5,
        )
        return converted


def _saved_state_precision(values):
    """Whether trailing checkpoint values look like a seed state and masters:
    a seed state (two integers) and/or float32 arrays."""
    values = [np.asarray(v) for v in values]
    return bool(values) and all(
        (np.issubdtype(v.dtype, np.integer) and v.shape == (2,))
        or v.dtype == np.float32
        for v in values
    )
