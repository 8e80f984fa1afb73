"""Optimizer-state precision: `state_dtype`, stochastic rounding, masters.

`StatePrecisionMixin`, a base of `OptimizerWrapper`: 16-bit and float8
slots of the innermost Keras optimizer (created, updated in float32 and
stored rounded, to nearest or stochastically). It composes
`master_weights.py` (float32 master copies of 16-bit weights) and
`state_conversion.py` (checkpoints saved with other settings). Imports
those, `keras_mp.backend`, `keras_mp._random_bits`,
`keras_mp._keras_internals`, `optimizers/float8_state.py` and
`optimizers/overwrite_with_gradient.py`; never `optimizers/wrapper.py` or a
module above it.
"""

import random
import warnings

import keras
import numpy as np
from keras import ops

from keras_mp import _keras_internals
from keras_mp import _random_bits
from keras_mp.backend import optimizer_state
from keras_mp.backend.torch import fused_state_update
from keras_mp.optimizers import float8_state
from keras_mp.optimizers.master_weights import HALF_DTYPES
from keras_mp.optimizers.master_weights import MasterWeightsMixin
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient
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
            _float8_slots=None,
            _weight_decay_exclusions=None,
            # Drawn now, as Keras layers draw theirs, not at build: after
            # `keras.utils.set_random_seed`, an optimizer created alike
            # rounds alike however many others are built before it trains.
            _stochastic_rounding_seed=(
                random.randint(1, int(1e9)) if stochastic_rounding else None
            ),
        )
        if state_dtype is not None:
            self._install_state_dtype(self._base_optimizer())

    def _install_state_dtype(self, base):
        """Hooks the base optimizer's slot creation and slot stores.

        Keras optimizers create their slots with `add_variable_from_reference`,
        update each variable in `update_step` and store with
        `self.assign`/`assign_add`/`assign_sub`. The hooks, set on this
        instance only, create slots in `state_dtype`, run `update_step` for
        a float32 variable in a float32 autocast scope (so every read of a
        slot is upcast and the update's math is float32), and compute each
        slot store in float32, rounding once at the end.
        """
        state_dtype = self._state_dtype
        if state_dtype == "float8":
            self._install_float8_state(base)
            return
        slot_ids = set()
        _hook_slot_creation(
            base,
            state_dtype,
            lambda reference, name, slot: slot_ids.add(id(slot)),
        )
        if state_dtype not in HALF_DTYPES:
            # float32 slots store the float32 result as it is. Torch's bulk
            # updates could not store into slots of another dtype than the
            # variable's.
            optimizer_state.route_updates_through_update_step(base)
            return
        assign = base.assign
        round_state = self._round_state

        def store(combine):
            def hooked(variable, value):
                if id(variable) in slot_ids:
                    value = round_state(combine(variable, value))
                    target = assign
                else:
                    target = combine.original
                # Stored outside the float32 scope: the backend's store reads
                # the variable itself, not an upcast copy of it.
                with _keras_internals.without_autocast():
                    return target(variable, value)

            return hooked

        update_step = base.update_step

        def hooked_update_step(gradient, variable, learning_rate):
            if keras.backend.standardize_dtype(variable.dtype) != "float32":
                # A 16-bit variable's update stays in its dtype, as Keras
                # computes it; `master_weights` gives it float32 math.
                return update_step(gradient, variable, learning_rate)
            with _keras_internals.AutocastScope("float32"):
                return update_step(gradient, variable, learning_rate)

        base.__dict__["update_step"] = hooked_update_step
        # Torch's bulk updates could not store into slots of another dtype
        # than the variable's, nor round them: the update goes through
        # `update_step` and the hooks below, or on PyTorch, for Keras's
        # Adam, AdamW, SGD and RMSprop, through the same update fused into
        # a few in-place calls per batch of elements.
        optimizer_state.route_updates_through_update_step(
            base,
            fused_state_update.FusedStateUpdate(
                base,
                state_dtype,
                self._stochastic_rounding,
                seed_generator=lambda: self._seed_generator,
                update_step=hooked_update_step,
            )
            if keras.backend.backend() == "torch"
            else None,
        )
        # Without XLA, TensorFlow runs each cast of a slot (read upcast,
        # store rounded) as a kernel pass of its own.
        optimizer_state.compile_update_with_xla(base)

        for name, combine in (
            ("assign", lambda variable, value: ops.cast(value, "float32")),
            (
                "assign_add",
                lambda variable, value: ops.add(
                    ops.cast(variable, "float32"), ops.cast(value, "float32")
                ),
            ),
            (
                "assign_sub",
                lambda variable, value: ops.subtract(
                    ops.cast(variable, "float32"), ops.cast(value, "float32")
                ),
            ),
        ):
            combine.original = getattr(base, name)
            base.__dict__[name] = store(combine)

    def _install_float8_state(self, base):
        """Hooks the base optimizer's slot creation and update for float8
        state (`float8_state.py`): each slot is created as uint8 E4M3
        codes of its own shape followed by a float32 variable of block
        scales, and `update_step` runs Adam's update on the decoded
        moments."""
        if not float8_state.supports(base):
            raise ValueError(
                "state_dtype='float8' holds the moments of Keras's Adam and "
                "AdamW (E4M3 codes with block scales, updated by keras_mp's "
                "float32 copy of their update). Received: inner optimizer "
                f"{base.name!r} of class {type(base).__name__}. Use "
                "state_dtype='bfloat16' for other optimizers."
            )
        slots = float8_state.Float8Slots(
            base,
            (lambda: self._seed_generator)
            if self._stochastic_rounding
            else None,
        )
        self.__dict__["_float8_slots"] = slots
        create = base.add_variable

        def check(name, initializer):
            if name not in float8_state.ADAM_SLOTS or initializer != "zeros":
                raise ValueError(
                    "state_dtype='float8' holds Adam's moments only (slots "
                    f"{sorted(float8_state.ADAM_SLOTS)}, starting at zero). "
                    f"Received: a slot {name!r} of {base.name!r} with "
                    f"initializer {initializer!r}. Use state_dtype='bfloat16'."
                )

        def add_scales(reference_variable, name, codes):
            size = int(np.prod(reference_variable.shape))
            scales = create(
                shape=(float8_state.block_count(size),),
                initializer="ones",
                dtype="float32",
                name=f"{codes.name}_scale",
            )
            slots.add(reference_variable, name, codes, scales)

        _hook_slot_creation(base, "uint8", add_scales, check)
        update_step = base.update_step

        def hooked_update_step(gradient, variable, learning_rate):
            if not slots.holds(variable):
                return update_step(gradient, variable, learning_rate)
            return slots.update_step(gradient, variable, learning_rate)

        base.__dict__["update_step"] = hooked_update_step
        optimizer_state.route_updates_through_update_step(base)
        optimizer_state.compile_update_with_xla(base)

    def _round_state(self, value):
        """A float32 `value` stored in `state_dtype`."""
        if self._stochastic_rounding:
            return stochastic_round_to_bfloat16(value, self._seed_generator)
        return ops.cast(value, self._state_dtype)

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


def _hook_slot_creation(base, dtype, on_slot, check=None):
    """Makes `base` create its state slots in `dtype`: every slot made from
    a float variable by `add_variable_from_reference`, except Keras's slots
    that are not state (`NON_STATE_SLOT_NAMES`) and those of a variable
    that overwrites itself with its gradient. `check(name, initializer)`
    may refuse a slot before it is made; `on_slot(reference, name, slot)`
    is told of each one made."""
    create_from_reference = base.add_variable_from_reference
    create = base.add_variable
    # Set while `add_variable_from_reference` creates a slot, whose
    # `add_variable` call then gets the state dtype.
    creating_slot = []

    def add_variable_from_reference(
        reference_variable, name=None, initializer="zeros"
    ):
        if (
            name in _keras_internals.NON_STATE_SLOT_NAMES
            or not keras.backend.is_float_dtype(reference_variable.dtype)
            or overwrites_with_gradient(reference_variable)
        ):
            return create_from_reference(reference_variable, name, initializer)
        if check is not None:
            check(name, initializer)
        creating_slot.append(True)
        try:
            slot = create_from_reference(reference_variable, name, initializer)
        finally:
            creating_slot.pop()
        on_slot(reference_variable, name, slot)
        return slot

    def add_variable(*args, **kwargs):
        if creating_slot:
            kwargs["dtype"] = dtype
        return create(*args, **kwargs)

    base.__dict__["add_variable_from_reference"] = add_variable_from_reference
    base.__dict__["add_variable"] = add_variable


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


def stochastic_round_to_bfloat16(value, seed):
    """`value` rounded to bfloat16 up or down at random, without bias.

    A float32 is rounded up (away from zero) with probability equal to its
    distance from the bfloat16 below, measured in bfloat16 steps: 16 random
    bits are added to the low half of its bit pattern, which is then cut
    off. The expected result is `value` itself, so increments far below one
    bfloat16 step (an EMA's `(1 - beta) * (g - m)`) still move the state on
    average; rounding to nearest drops them every time. NaN stays NaN,
    infinities stay infinite.

    The bits come from a counter-based hash of each element's index and a
    key drawn from `seed`: a few integer operations per element, against
    the many of `keras.random`'s generators (Threefry, Philox), and no host
    round trip on any backend.

    Args:
        value: A float32 tensor.
        seed: A `keras.random.SeedGenerator`.

    Returns:
        A bfloat16 tensor of the same shape.
    """
    seed = ops.cast(seed.next(), "int32")
    # About twenty elementwise integer operations: one fused loop under
    # XLA, but on TensorFlow without XLA (Keras's default there) each would
    # be a pass over the whole slot, so they are compiled as one kernel.
    round_stochastically = optimizer_state.compiled_elementwise(
        _round_stochastically
    )
    return round_stochastically(ops.cast(value, "float32"), seed)


def _round_stochastically(value, seed):
    """`stochastic_round_to_bfloat16` of a float32 `value` with the int32
    key pair `seed` (a `SeedGenerator`'s draw)."""
    bits = ops.view(value, "int32")
    noise = ops.bitwise_and(
        _random_bits.random_bits(ops.shape(value), seed), 0xFFFF
    )
    # -65536 is 0xFFFF0000: the sign, exponent and bfloat16 mantissa bits.
    # A carry out of the low half moves to the next bfloat16 value.
    truncated = ops.view(ops.bitwise_and(bits + noise, -65536), "float32")
    rounded = ops.where(ops.isnan(value), value, truncated)
    return ops.cast(rounded, "bfloat16")


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
