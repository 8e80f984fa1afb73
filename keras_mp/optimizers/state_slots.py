"""The inner optimizer's slots in a `StateFormat`, and the one place that
makes the optimizer create, update and store them.

`StateSlots` is all that `state_dtype` changes in a Keras optimizer. Keras
optimizers create their slots with `add_variable_from_reference`, update
each variable in `update_step` (or, on PyTorch, all at once with
`torch._foreach_*`) and store with `assign`/`assign_add`/`assign_sub`;
`install` sets, on the inner optimizer instance only (its `__dict__`,
never its class), in this one method:

- `add_variable_from_reference`/`add_variable`: each state slot is made
  with the format's variables (`StateFormat.variables`), recorded here;
- `update_step`: for a 16-bit format, Keras's own update for a float32
  variable, in a float32 autocast scope (every read of a slot is upcast,
  the math is float32); for float8, Adam's update on the decoded moments
  (`float8_state.Float8Adam`, whose bits Keras's update cannot give);
- `assign`/`assign_add`/`assign_sub` (16-bit formats): a slot store is
  computed in float32 and written by the format, rounded once;
- `_backend_update_step`: the update goes through `update_step` (PyTorch's
  bulk update would bypass the stores), or PyTorch's fused update of the
  same bits (`backend/torch/fused_state_update.py`), and is compiled with
  XLA on TensorFlow (`backend/optimizer_state.py`).

The optimizer's rule is Keras's `update_step` wherever its bits can be
kept: float32 and 16-bit state. Elsewhere (float8 state, PyTorch's fused
update) it is the one writing of the same rule in `update_rules.py`.
"""

import keras
from keras import ops

from keras_mp import _keras_internals
from keras_mp._fp8.formats import e4m3_e5m2
from keras_mp.backend import optimizer_state
from keras_mp.backend.torch import float8_codes
from keras_mp.backend.torch import fused_state_update
from keras_mp.optimizers import float8_state
from keras_mp.optimizers import state_formats
from keras_mp.optimizers import update_rules
from keras_mp.optimizers.master_weights import HALF_DTYPES
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient


class StateSlots:
    """The slots of one optimizer in a `StateFormat` (see the module).

    Args:
        optimizer: The innermost Keras optimizer, not built yet.
        state_format: Its `StateFormat`.
        seed_generator: A callable returning the wrapper's
            `keras.random.SeedGenerator` (created when the wrapper is
            built), or None to round to nearest.
    """

    def __init__(self, optimizer, state_format, seed_generator):
        self._optimizer = optimizer
        # The optimizer's own `assign`, before `install` hooks the stores:
        # `write` stores what the format made, rounded once.
        self._assign = optimizer.assign
        self.format = state_format
        self._seed_generator = seed_generator
        # The optimizer's key of a reference variable (on TensorFlow,
        # `update_step` gets the `tf.Variable` inside the Keras one) ->
        # {slot name: [stored variables]}.
        self._slots = {}
        # id(slot variable) -> (its stored variables, its slot name).
        self._stored = {}
        self.rule = (
            float8_state.Float8Adam(optimizer, self)
            if state_format.name == "float8"
            else None
        )

    # ------------------------------------------------------------ records
    def holds(self, variable):
        """Whether `variable` (a reference variable) has slots here."""
        return self._optimizer._var_key(variable) in self._slots

    def slots_of(self, variable):
        """{slot name: its stored variables} of reference `variable`."""
        return self._slots[self._optimizer._var_key(variable)]

    def stored(self, slot):
        """The stored variables of a slot variable (the slot first), or
        None for a variable that is no state slot."""
        entry = self._stored.get(id(slot))
        return None if entry is None else entry[0]

    def slot_name(self, slot):
        """Keras's name of a state slot ("momentum", ...), or None."""
        entry = self._stored.get(id(slot))
        return None if entry is None else entry[1]

    def read(self, variable, name):
        """The float32 value of slot `name` of reference `variable`."""
        stored = self.slots_of(variable)[name]
        return self.format.read([v.value for v in stored])

    def write(self, variable, name, value, seed=None):
        """Stores float32 `value` in slot `name` of reference `variable`."""
        stored = self.slots_of(variable)[name]
        for target, new in zip(stored, self.format.write(value, seed)):
            self._assign(target, new)

    def next_seed(self):
        """The int32 key pair of one stochastically rounded store, or None
        without stochastic rounding."""
        if self._seed_generator is None:
            return None
        return ops.cast(self._seed_generator().next(), "int32")

    # -------------------------------------------------------------- hooks
    def install(self):
        """Sets the hooks on the optimizer instance (see the module)."""
        base = self._optimizer
        self._hook_slot_creation()
        if self.rule is None and self.format.name not in HALF_DTYPES:
            # float32 slots store the float32 result as it is. Torch's bulk
            # updates could not store into slots of another dtype than the
            # variable's.
            optimizer_state.route_updates_through_update_step(base)
            return
        update_step = self._hook_update_step(self.rule)
        if self.rule is None:
            self._hook_stores()
        # Torch's bulk updates could not store into slots of another dtype
        # than the variable's, nor round them: the update goes through
        # `update_step` and the stores, or on PyTorch, for Keras's Adam,
        # AdamW, SGD and RMSprop (float8: Adam and AdamW), through the same
        # update fused into a few in-place calls per batch of elements.
        optimizer_state.route_updates_through_update_step(
            base,
            self._fused_update(update_step)
            if keras.backend.backend() == "torch"
            else None,
        )
        # Without XLA, TensorFlow runs each cast of a slot (read upcast,
        # store rounded) as a kernel pass of its own.
        optimizer_state.compile_update_with_xla(base)

    def _fused_update(self, update_step):
        """PyTorch's fused update of these slots (`FusedStateUpdate`)."""
        float8 = self.format.name == "float8"
        return fused_state_update.FusedStateUpdate(
            self._optimizer,
            self.format.name,
            self.format.stochastic_rounding,
            seed_generator=self._seed_generator,
            update_step=update_step,
            rules=update_rules.RULES,
            storage=float8_state.STORAGE if float8 else update_rules.Storage(),
            float8_codes=(
                float8_codes.Float8Codes(
                    e4m3_e5m2.scale_from_amax,
                    e4m3_e5m2.e4m3_value_table(),
                    state_formats.BLOCK_SIZE,
                    e4m3_e5m2.e4m3_code_program,
                    e4m3_e5m2.torch_scale_constants("e4m3", 0),
                    e4m3_e5m2.e4m3_code_constants(),
                )
                if float8
                else None
            ),
            scales_of=(
                (lambda slot: (self.stored(slot) or [None, None])[1])
                if float8
                else None
            ),
        )

    def _hook_slot_creation(self):
        """Makes the optimizer create its state slots in the format: every
        slot made from a float variable by `add_variable_from_reference`,
        except Keras's slots that are not state (`NON_STATE_SLOT_NAMES`)
        and those of a variable that overwrites itself with its gradient."""
        base = self._optimizer
        create_from_reference = base.add_variable_from_reference
        create = base.add_variable
        state_format = self.format
        # Set while `add_variable_from_reference` creates a slot, whose
        # `add_variable` call then gets the format's dtype.
        creating_slot = []

        def add_variable_from_reference(
            reference_variable, name=None, initializer="zeros"
        ):
            if (
                name in _keras_internals.NON_STATE_SLOT_NAMES
                or not keras.backend.is_float_dtype(reference_variable.dtype)
                or overwrites_with_gradient(reference_variable)
            ):
                return create_from_reference(
                    reference_variable, name, initializer
                )
            if self.rule is not None:
                self.rule.check_slot(name, initializer)
            creating_slot.append(True)
            try:
                slot = create_from_reference(
                    reference_variable, name, initializer
                )
            finally:
                creating_slot.pop()
            stored = [slot]
            for suffix, shape, dtype, init in state_format.variables(
                tuple(reference_variable.shape)
            )[1:]:
                stored.append(
                    create(
                        shape=shape,
                        initializer=init,
                        dtype=dtype,
                        name=f"{slot.name}{suffix}",
                    )
                )
            key = base._var_key(reference_variable)
            self._slots.setdefault(key, {})[name] = stored
            self._stored[id(slot)] = (stored, name)
            return slot

        def add_variable(*args, **kwargs):
            if creating_slot:
                kwargs["dtype"] = state_format.dtype
            return create(*args, **kwargs)

        base.__dict__["add_variable_from_reference"] = (
            add_variable_from_reference
        )
        base.__dict__["add_variable"] = add_variable

    def _hook_update_step(self, rule):
        """Sets `update_step`: `rule`'s for the variables with slots here,
        or Keras's in a float32 autocast scope (None). Returns it."""
        update_step = self._optimizer.update_step

        def hooked_update_step(gradient, variable, learning_rate):
            if rule is not None:
                if not self.holds(variable):
                    return update_step(gradient, variable, learning_rate)
                return rule.update_step(gradient, variable, learning_rate)
            if keras.backend.standardize_dtype(variable.dtype) != "float32":
                # A 16-bit variable's update stays in its dtype, as Keras
                # computes it; `master_weights` gives it float32 math.
                return update_step(gradient, variable, learning_rate)
            with _keras_internals.AutocastScope("float32"):
                return update_step(gradient, variable, learning_rate)

        self._optimizer.__dict__["update_step"] = hooked_update_step
        return hooked_update_step

    def _hook_stores(self):
        """Makes each store into a slot compute in float32 and write through
        the format, rounded once."""
        base = self._optimizer
        assign = base.assign
        state_format = self.format

        def store(combine, original):
            def hooked(variable, value):
                if id(variable) in self._stored:
                    value = state_format.write(
                        combine(variable, value), self.next_seed()
                    )[0]
                    target = assign
                else:
                    target = original
                # Stored outside the float32 scope: the backend's store reads
                # the variable itself, not an upcast copy of it.
                with _keras_internals.without_autocast():
                    return target(variable, value)

            return hooked

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
            base.__dict__[name] = store(combine, getattr(base, name))
