"""Checkpoints of optimizers: restore whole or not at all, also before build.

`CheckpointMixin`, a base of `OptimizerWrapper`: the wrapper's checkpoint
layout (the inner optimizer's variables under its own path, the wrapper's
own in `WrapperState`), restore that holds values until `build` creates
the variables, `get_weights`/`set_weights`; and `restore_at_build`, which
`Model.compile` applies to the plain Keras optimizers it keeps. Imports
`keras_mp.backend` and `keras_mp._keras_internals`; never
`optimizers/wrapper.py` or a module above it.
"""

import warnings
import weakref

import keras
import numpy as np
from keras import ops

from keras_mp import _keras_internals
from keras_mp.backend import training_state


class WrapperState(_keras_internals.KerasSaveable):
    """The variables a chain of wrappers adds, saved beside the inner layout.

    The wrapper's own `vars` entry holds exactly what the innermost Keras
    optimizer would save, so a plain optimizer reads it; this object saves
    the rest (loss scale, transform state) under a path of its own, which a
    plain optimizer never visits. A checkpoint without it (one written by a
    plain optimizer) leaves these variables at their current values.

    Keras loads the wrapper's own entry, then this one; the wrapper restores
    both together (see `OptimizerWrapper._restore`).
    """

    def __init__(self, wrapper):
        # A weak reference: saving walks attributes, and a strong one would
        # lead it back to the wrapper in a cycle.
        self._wrapper_ref = weakref.ref(wrapper)

    def _obj_type(self):
        return "Optimizer"

    def _variables(self):
        return self._wrapper_ref()._wrapper_variables()

    def save_own_variables(self, store):
        for i, variable in enumerate(self._variables()):
            store[str(i)] = keras.ops.convert_to_numpy(variable.value)

    def load_own_variables(self, store):
        self._wrapper_ref()._restore(wrapper_values=_read_store(store))


def _read_store(store):
    """The values of a weights-store entry, in order, as numpy arrays."""
    return [np.array(store[str(i)]) for i in range(len(store.keys()))]


def _assign_all(variables, values, what):
    """Assigns every value or none: count and shapes are checked first."""
    if len(values) != len(variables):
        raise ValueError(
            f"Expected {len(variables)} values for {what} "
            f"({[v.path for v in variables]}). Received {len(values)}. "
            "Nothing was loaded or assigned. Use values saved from an optimizer "
            "wrapped and built the same way (same inner optimizer, loss "
            "scale kind, transforms and trainable variables)."
        )
    for variable, value in zip(variables, values):
        if tuple(variable.shape) != tuple(np.shape(value)):
            raise ValueError(
                f"Cannot assign a value of shape {tuple(np.shape(value))} to "
                f"variable {variable.path!r} of shape "
                f"{tuple(variable.shape)} ({what}). Nothing was loaded or "
                "assigned."
            )
    training_state.assign_once(
        variables, _converted_to_variable_dtypes(variables, values, what)
    )


def _converted_to_variable_dtypes(variables, values, what):
    """`values` in their variables' float dtypes, with a warning naming every
    conversion: a checkpoint's arrays carry the dtype they were saved in, so
    float32 optimizer state loads into bfloat16 state (rounded to nearest)
    and back (exact), and neither happens silently."""
    converted, conversions = [], {}
    for variable, value in zip(variables, values):
        value = np.asarray(value)
        source = keras.backend.standardize_dtype(value.dtype)
        target = keras.backend.standardize_dtype(
            _keras_internals.stored_dtype(variable)
        )
        if (
            source != target
            and keras.backend.is_float_dtype(source)
            and keras.backend.is_float_dtype(target)
        ):
            conversions.setdefault((source, target), []).append(variable.path)
            # In NumPy: this may run while a TensorFlow step is traced.
            value = value.astype(_numpy_dtype(target))
        converted.append(value)
    for (source, target), paths in conversions.items():
        lossy = any(
            a < b
            for a, b in zip(
                _FLOAT_BITS[target], _FLOAT_BITS.get(source, (99, 99))
            )
        )
        how = "rounded to nearest" if lossy else "exactly"
        warnings.warn(
            f"Converted {len(paths)} value(s) from {source} to {target} "
            f"({how}) while loading {what}: the checkpoint holds {source} "
            f"values for {target} variables ({', '.join(paths[:3])}"
            f"{', ...' if len(paths) > 3 else ''}). This is expected when "
            "optimizer state saved with another `state_dtype` is loaded.",
            stacklevel=4,
        )
    return converted


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


# (mantissa bits, exponent bits): a conversion is exact where neither shrinks.
_FLOAT_BITS = {
    "float16": (10, 5),
    "bfloat16": (7, 8),
    "float32": (23, 8),
    "float64": (52, 11),
}


class CheckpointMixin:
    """Checkpoint restore of an `OptimizerWrapper`, all of it or none.

    Relies on the wrapper's `variables`, `_base_optimizer()`,
    `_wrapper_variables()`, `_matching_state_precision` and
    `_matching_inner_state` (from `state_conversion.py`).
    """

    def save_own_variables(self, store):
        self._base_optimizer().save_own_variables(store)

    def load_own_variables(self, store):
        self._restore(inner_values=_read_store(store))

    def _restore(self, inner_values=None, wrapper_values=None):
        """Restores checkpointed state, all of it or none.

        Keras's loader calls `load_own_variables` (the inner optimizer's
        layout) and then `WrapperState.load_own_variables` (the wrapper's
        own variables, an empty entry in a plain optimizer's checkpoint).
        The first is held until the second arrives, so a mismatch in either
        leaves every variable as it was. Into an optimizer that is not built
        yet (a fresh model compiled, then `load_weights`), the values are
        kept until `build` creates the variables, so training resumes where
        it stopped instead of from a fresh optimizer state; kept values that
        do not fit the variables built then (the rest of that load failed)
        are skipped with a warning.
        """
        if inner_values is not None:
            self.__dict__["_pending_restore"] = {"inner": inner_values}
            return
        pending = self.__dict__.setdefault("_pending_restore", {})
        pending["wrapper"] = wrapper_values
        if self.built:
            self._commit_restore()

    def _commit_restore(self, deferred=False):
        pending = self.__dict__.pop("_pending_restore", None) or {}
        if deferred and "weights" not in pending:
            # Held since a `load_weights` into this unbuilt optimizer, which
            # may have failed as a whole (Keras reports a layer's mismatch
            # after loading every object): a checkpoint that does not fit
            # the variables now built is skipped, as Keras skips an unbuilt
            # optimizer's, instead of failing this first training step.
            try:
                self._commit_checkpoint(pending)
            except ValueError as error:
                warnings.warn(
                    f"Skipping the optimizer state loaded into {self.name!r} "
                    "before it was built: it does not fit the variables it "
                    f"was built for ({error}) The optimizer starts fresh. "
                    "Load a checkpoint saved from the same model and "
                    "optimizer.",
                    stacklevel=3,
                )
            return
        if "weights" in pending:
            _assign_all(
                self.variables,
                pending["weights"],
                f"optimizer {self.name!r}'s weights",
            )
            return
        self._commit_checkpoint(pending)

    def _commit_checkpoint(self, pending):
        variables, values = [], []
        inner_values = pending.get("inner")
        if inner_values is not None:
            inner_variables = self._base_optimizer().variables
            inner_values = self._matching_inner_state(
                inner_variables, inner_values
            )
            if len(inner_values) != len(inner_variables):
                # As Keras does for a plain optimizer: the checkpoint of an
                # optimizer built for other variables (or not built) is
                # skipped with a warning.
                warnings.warn(
                    f"Skipping variable loading for optimizer {self.name!r}: "
                    f"the checkpoint holds {len(inner_values)} variables of "
                    f"the inner optimizer, which has {len(inner_variables)}. "
                    "It was likely saved before the optimizer was built "
                    "(before the first training step), or for other "
                    "trainable variables.",
                    stacklevel=3,
                )
                return
            variables += inner_variables
            values += inner_values
        wrapper_values = pending.get("wrapper")
        if wrapper_values:
            wrapper_variables, wrapper_values = self._matching_state_precision(
                self._wrapper_variables(), wrapper_values
            )
            variables += wrapper_variables
            values += wrapper_values
        _assign_all(variables, values, f"optimizer {self.name!r}'s checkpoint")

    def get_weights(self):
        """The values of `variables`, as numpy arrays, in the same order."""
        return [ops.convert_to_numpy(v.value) for v in self.variables]

    def set_weights(self, weights):
        """Assigns `get_weights()`'s output of an optimizer built the same way.

        The values follow the order of `variables` (the inner optimizer's,
        then the wrapper's own). Count and shapes are checked before any
        assignment, so a mismatch leaves every variable as it was. On an
        optimizer that is not built yet (as Keras's legacy `.h5` loader
        finds it), the values are assigned when `build` creates the
        variables, and a mismatch is reported then.
        """
        weights = [np.asarray(w) for w in weights]
        if not self.built:
            self.__dict__["_pending_restore"] = {"weights": weights}
            return
        _assign_all(
            self.variables, list(weights), f"optimizer {self.name!r}'s weights"
        )


def restore_at_build(optimizer):
    """Makes `optimizer` keep a checkpoint loaded before it is built.

    Keras skips the state of an optimizer that is not built yet when the
    checkpoint loads (a fresh model compiled, then `load_weights`, or a
    keras-hub task from `load_model`): training would then resume with
    `iterations` at 0 and empty slots, unlike the run that saved it.
    keras_mp's wrappers hold such values until `build` creates the
    variables; this gives a plain Keras optimizer the same behaviour, on
    this instance only. At `build`, values that do not fit the variables
    are dropped with a warning that names them, as Keras does.

    Args:
        optimizer: A `keras.optimizers.Optimizer`. keras_mp's wrappers
            (which restore at build already) are left as they are.
    """
    if isinstance(optimizer, CheckpointMixin) or (
        "_keras_mp_restores_at_build" in optimizer.__dict__
    ):
        return
    load_own_variables = optimizer.load_own_variables
    build = optimizer.build

    def load_own_variables_at_build(store):
        if optimizer.built:
            load_own_variables(store)
            return
        optimizer.__dict__["_keras_mp_pending_restore"] = [
            np.array(store[str(i)]) for i in range(len(store.keys()))
        ]

    def build_then_restore(var_list):
        build(var_list)
        if optimizer.built:
            pending = optimizer.__dict__.pop("_keras_mp_pending_restore", None)
            if pending is not None:
                _restore(optimizer, pending)

    # Set past Keras's attribute tracking, as the wrappers' hooks are.
    optimizer.__dict__.update(
        load_own_variables=load_own_variables_at_build,
        build=build_then_restore,
        _keras_mp_restores_at_build=True,
    )


def _restore(optimizer, values):
    # `_assign_all` checks count and shapes before assigning anything; as
    # Keras skips an unbuilt optimizer's state, a mismatch found only now
    # is dropped with a warning rather than failing the first step.
    try:
        _assign_all(
            optimizer.variables,
            values,
            f"optimizer {optimizer.name!r}'s checkpoint",
        )
    except ValueError as error:
        warnings.warn(
            f"Dropped the state of optimizer {optimizer.name!r} loaded "
            f"before it was built: {error} It starts fresh (iterations 0, "
            "empty slots). Load a checkpoint saved from the same model and "
            "optimizer class.",
            stacklevel=4,
        )
