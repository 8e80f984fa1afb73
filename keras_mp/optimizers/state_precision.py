"""Optimizer-state precision: `state_dtype`, stochastic rounding, masters.

`StatePrecisionMixin`, a base of `OptimizerWrapper`: the settings, checked
here (`check_state_arguments`, `check_state_precision_target`). The slots
of the innermost Keras optimizer in `state_dtype` are one `StateFormat`
(`state_formats.py`: how a slot is stored, read and written) and one
`StateSlots` (`state_slots.py`: the slots, and the hooks that make the
optimizer create, update and store them). It composes `master_weights.py`
(float32 master copies of 16-bit weights) and `state_conversion.py`
(checkpoints saved with other settings).
"""

import random
import warnings

import keras

from keras_mp.optimizers import state_formats
from keras_mp.optimizers import state_slots
from keras_mp.optimizers.master_weights import MasterWeightsMixin
from keras_mp.optimizers.state_conversion import StateConversionMixin

# The dtypes `state_dtype` takes. float16 state only suits slots that stay
# within its range (it flushes Adam's squared gradients below 6e-8 to zero,
# and says so at build); bfloat16 has float32's range.
_STATE_DTYPES = ("bfloat16", "float16", "float32", "float8")
# Keras's optimizers whose slots accumulate squared gradients, which float16
# flushes to zero (`_build_state_precision` warns).
_SQUARED_GRADIENT_OPTIMIZERS = (
    keras.optimizers.Adam,
    keras.optimizers.Nadam,
    keras.optimizers.Lamb,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Adafactor,
)


class StatePrecisionMixin(MasterWeightsMixin, StateConversionMixin):
    """State dtype, stochastic rounding and master weights of a wrapper.

    Set up by `_init_state_precision` (from the wrapper's constructor) and
    `_build_state_precision` (from `build`, before the inner optimizer is
    built); `apply_updates` maps gradients onto the masters with
    `_to_master_weights` and writes them back after the update
    (`MasterWeightsMixin`); `checkpointing.py` matches checkpoint values
    with `StateConversionMixin`'s methods.
    """

    def _init_state_precision(
        self, state_dtype, stochastic_rounding, master_weights
    ):
        # Plain containers, set past Keras's attribute tracking, which
        # would also list the variables they hold in `self._variables`.
        self.__dict__.update(
            _state_dtype=state_dtype,
            _stochastic_rounding=stochastic_rounding,
            _master_weights=master_weights,
            _state_precision_variables=[],
            _master_variables={},
            _state_slots=None,
            _weight_decay_exclusions=None,
            # Drawn now, as Keras layers draw theirs, not at build: after
            # `keras.utils.set_random_seed`, an optimizer created alike
            # rounds alike however many others are built before it trains.
            _stochastic_rounding_seed=(
                random.randint(1, int(1e9)) if stochastic_rounding else None
            ),
        )
        if state_dtype is not None:
            slots = state_slots.StateSlots(
                self._base_optimizer(),
                state_formats.state_format(state_dtype, stochastic_rounding),
                (lambda: self._seed_generator) if stochastic_rounding else None,
            )
            slots.install()
            self.__dict__["_state_slots"] = slots

    def _build_state_precision(self, var_list):
        """Creates the seed state and the masters; the inner optimizer's list.

        Called by `build` before the inner optimizer is built, which then
        builds on the masters in place of their variables.
        """
        if self._state_dtype == "float16" and isinstance(
            self._inner_optimizer, _SQUARED_GRADIENT_OPTIMIZERS
        ):
            name = type(self._inner_optimizer).__name__
            warnings.warn(
                f"state_dtype='float16' on optimizer {self.name!r} keeps "
                f"{name}'s accumulated squared gradients in float16, which "
                "flushes values below 6e-8 to zero: with Adam's "
                "(1 - beta_2) * g**2 that is every gradient under about "
                "8e-3, and the update then divides by epsilon alone, "
                "moving weights by far more than the learning rate. "
                "Use state_dtype='bfloat16' (float32's range in the same "
                "2 bytes) or 'float8' (Adam and AdamW).",
                stacklevel=4,
            )
        if self._stochastic_rounding:
            self._seed_generator = keras.random.SeedGenerator(
                seed=self._stochastic_rounding_seed, name="stochastic_rounding"
            )
            self._state_precision_variables.append(self._seed_generator.state)
        return self._build_master_weights(var_list)


def check_state_arguments(state_dtype, stochastic_rounding, master_weights):
    """Validated `state_dtype` and `stochastic_rounding` (None resolved)."""
    if state_dtype is not None:
        try:
            standardized = (
                "float8"
                if state_dtype == "float8"
                else keras.backend.standardize_dtype(state_dtype)
            )
        except ValueError:
            standardized = None
        if standardized not in _STATE_DTYPES:
            raise ValueError(
                "`state_dtype` must be one of "
                f"{', '.join(repr(d) for d in _STATE_DTYPES)} or None. "
                f"Received: state_dtype={state_dtype!r}. Use "
                "state_dtype='bfloat16' to halve float32 optimizer state, "
                "or 'float8' (Adam and AdamW) to quarter it."
            )
        state_dtype = standardized
    if stochastic_rounding is None:
        stochastic_rounding = state_dtype in ("bfloat16", "float8")
    elif not isinstance(stochastic_rounding, bool):
        raise TypeError(
            "`stochastic_rounding` must be a bool or None. Received: "
            f"stochastic_rounding={stochastic_rounding!r}"
        )
    elif stochastic_rounding and state_dtype not in ("bfloat16", "float8"):
        raise ValueError(
            "Stochastic rounding applies to bfloat16 and float8 optimizer "
            "state only (float32 state is not rounded; float16 state rounds "
            f"to nearest). Received: state_dtype={state_dtype!r}, "
            "stochastic_rounding=True. Use state_dtype='bfloat16' or "
            "'float8', or leave stochastic_rounding unset."
        )
    if not isinstance(master_weights, bool):
        raise TypeError(
            "`master_weights` must be a bool. Received: "
            f"master_weights={master_weights!r}"
        )
    return state_dtype, stochastic_rounding


def check_state_precision_target(optimizer, state_dtype, master_weights, name):
    """Refuses state precision settings the wrapped optimizer cannot take."""
    if state_dtype is None and not master_weights:
        return
    owner = _state_precision_owner(optimizer)
    if owner is not None:
        raise ValueError(
            "`state_dtype` and `master_weights` belong to one wrapper of a "
            f"chain, and the inner wrapper {owner.name!r} already sets them. "
            f"Received: state_dtype={state_dtype!r}, master_weights="
            f"{master_weights!r} on {name or 'the outer wrapper'!r}. Set "
            "them on one wrapper only."
        )
    base = optimizer
    while isinstance(base, StatePrecisionMixin):
        base = base.inner_optimizer
    if base.built:
        raise ValueError(
            "`state_dtype` and `master_weights` decide how the inner "
            "optimizer creates its variables, so it must not be built yet. "
            f"Received: the built optimizer {base.name!r}. Wrap a fresh "
            "optimizer."
        )


def _state_precision_owner(optimizer):
    """The wrapper in `optimizer`'s chain that sets state precision, or None."""
    while isinstance(optimizer, StatePrecisionMixin):
        if optimizer._state_dtype is not None or optimizer._master_weights:
            return optimizer
        optimizer = optimizer.inner_optimizer
    return None
