"""Autocasting variables: float32 storage, compute-dtype reads inside `call`.

Keras 3 already casts a layer's float variables to the compute dtype while
the layer runs (its `AutocastScope`). keras_mp makes that visible, as tf.keras
did: every float weight that a layer with a casting policy creates through
`add_weight` is an `AutoCastVariable` with a `true_dtype`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import NoReturn

import keras

from keras_mp import _keras_internals
from keras_mp.backend import devices


class _AutoCastVariableMeta(type):
    def __instancecheck__(cls, instance):
        return isinstance(instance, keras.Variable) and getattr(
            instance, "_keras_mp_autocast", False
        )


class AutoCastVariable(metaclass=_AutoCastVariableMeta):
    """A float variable that reads as the compute dtype inside a layer's call.

    Not constructed directly: a layer whose policy computes in a lower
    precision than it stores (`"mixed_float16"`, `"mixed_bfloat16"`) makes
    each float weight it creates with `add_weight` an `AutoCastVariable`,
    unless `add_weight(..., autocast=False)`. Inside that layer's `call`,
    `dtype` is the compute dtype and reads give compute-dtype tensors;
    elsewhere it behaves as the stored variable. `true_dtype` is always the
    stored dtype, and assignments keep it. The checkpoint format is a plain
    variable's, so float32 weights load into a mixed model and back.

    Example:

    >>> layer = keras.layers.Dense(2, dtype="mixed_float16")
    >>> layer.build((None, 3))
    >>> isinstance(layer.kernel, keras_mp.AutoCastVariable)
    True
    >>> layer.kernel.true_dtype, layer.kernel.dtype
    ('float32', 'float32')
    >>> with keras_mp.enable_autocast("float16"):
    ...     layer.kernel.dtype
    'float16'
    """

    # Documentation only (`help(keras_mp.AutoCastVariable)`): the variables
    # are Keras variables that this class recognizes, never its instances.
    true_dtype = property(
        doc="The dtype the variable stores, such as 'float32', everywhere."
    )
    dtype = property(
        doc="The compute dtype inside the call of the layer that owns the "
        "variable (e.g. 'float16'), the stored dtype elsewhere."
    )
    value = property(
        doc="The value, cast to the compute dtype inside the layer's call."
    )

    def __new__(cls, *args: object, **kwargs: object) -> NoReturn:
        """Not called by users: `layer.add_weight` creates the variables."""
        raise TypeError(
            "keras_mp.AutoCastVariable is not created directly. Create the "
            "weight with `layer.add_weight(...)` in a layer whose dtype policy "
            "is mixed (e.g. dtype='mixed_float16')."
        )


def _policy_casts(layer):
    # `compute_dtype` and `variable_dtype`, not `dtype_policy`'s: a layer
    # given a DTypePolicyMap answers them from its own entry in the map.
    return layer.compute_dtype != layer.variable_dtype


def _mixed_policy_name(layer):
    return f"mixed_{keras.backend.standardize_dtype(layer.compute_dtype)}"


def _mark(variable):
    dtype = keras.backend.standardize_dtype(
        _keras_internals.stored_dtype(variable)
    )
    if keras.backend.is_float_dtype(dtype):
        variable.true_dtype = dtype
        variable._keras_mp_autocast = True
        variable.assign = _at_stored_precision(variable.assign)
        variable.assign_add = _at_stored_precision(variable.assign_add)
        variable.assign_sub = _at_stored_precision(variable.assign_sub)


def set_marked(variable, casts):
    """Marks or unmarks a variable whose layer's policy changed after build.

    A precision rule applied once the model is known can make a built layer
    cast (or stop casting); its variables then are (or are no longer)
    `AutoCastVariable`s, as if the layer had been created with that policy.
    """
    if casts and not getattr(variable, "_keras_mp_autocast", False):
        _mark(variable)
    elif not casts:
        variable._keras_mp_autocast = False


def _at_stored_precision(update):
    # Keras's assign_add reads the variable through the autocast scope, so
    # inside a mixed layer's call the sum would be rounded to the compute
    # dtype before it is stored. On torch, `assign` itself writes into
    # `variable.value`, which inside that scope is a temporary cast copy:
    # the write would be lost.
    @functools.wraps(update)
    def update_at_stored_precision(value):
        with _keras_internals.without_autocast():
            return update(value)

    return update_at_stored_precision


def _install_add_weight_hook():
    original = keras.layers.Layer.add_weight
    if getattr(original, "_keras_mp_hook", False):
        return

    @functools.wraps(original)
    def add_weight(self, *args, **kwargs):
        variable = original(self, *args, **kwargs)
        if _keras_internals.variable_autocasts(variable) and _policy_casts(
            self
        ):
            _mark(variable)
            # Here rather than in set_global_policy: creating a variable
            # initializes the runtime anyway, setting a policy must not.
            devices.check_hardware_once(_mixed_policy_name(self))
        return variable

    add_weight._keras_mp_hook = True
    keras.layers.Layer.add_weight = add_weight


_install_add_weight_hook()


@contextlib.contextmanager
def enable_autocast(dtype: str | None) -> Iterator[None]:
    """Context manager that reads autocasting variables as `dtype`.

    Layers open this scope themselves around `call`; use it in custom code
    that reads a layer's weights outside `call` and wants the compute dtype.

    Args:
        dtype: A float dtype name such as `"float16"`, or None to read
            variables in their stored dtype.

    Example:

    >>> v = keras.Variable(1.5, dtype="float32")
    >>> with keras_mp.enable_autocast("bfloat16"):
    ...     keras.backend.standardize_dtype(v.value.dtype)
    'bfloat16'
    """
    if dtype is not None:
        try:
            dtype = keras.backend.standardize_dtype(dtype)
        except ValueError:
            raise ValueError(
                "`dtype` must be a float dtype name such as 'float16', or "
                f"None. Received: dtype={dtype!r}"
            ) from None
        if not keras.backend.is_float_dtype(dtype):
            raise ValueError(
                "`dtype` must be a float dtype name such as 'float16', or "
                f"None. Received: dtype={dtype!r}"
            )
    if dtype is None:
        with _keras_internals.without_autocast():
            yield
    else:
        with _keras_internals.AutocastScope(dtype):
            yield
