"""Checks of what an `OptimizerWrapper` is given.

The optimizer to wrap (`checked_inner_optimizer`) and the dtypes of the
gradients it applies (`check_gradient_dtypes`), each refused with a message
that names the fix.
"""

import keras

from keras_mp import _keras_internals


def checked_inner_optimizer(class_name, inner_optimizer, kwargs):
    """The optimizer to wrap (also as tf.keras's `optimizer=`, popped from
    `kwargs`), refused unless it is an unwrapped Keras optimizer."""
    if "optimizer" in kwargs:
        if inner_optimizer is not None:
            raise TypeError(
                "Pass the optimizer to wrap once, as `inner_optimizer`. "
                f"Received: inner_optimizer={inner_optimizer!r} and "
                f"optimizer={kwargs['optimizer']!r}"
            )
        inner_optimizer = kwargs.pop("optimizer")
    optimizer = inner_optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"{class_name} wraps a keras.optimizers.Optimizer. "
            f"Received: inner_optimizer={optimizer!r} (of type "
            f"{type(optimizer).__name__}). Pass e.g. "
            "keras.optimizers.Adam(1e-3)."
        )
    owner = getattr(optimizer, "_keras_mp_wrapped_by", None)
    if owner is not None:
        raise ValueError(
            f"The optimizer {optimizer.name!r} is already wrapped by "
            f"{owner!r}; two wrappers cannot share one inner optimizer. "
            "Wrap a fresh optimizer, or wrap the existing wrapper."
        )
    return optimizer


def check_gradient_dtypes(grads_and_vars):
    """Raises ValueError for a float gradient whose dtype is not its
    variable's (e.g. taken from an autocast read)."""
    for grad, variable in grads_and_vars:
        if grad is None:
            continue
        grad_dtype = keras.backend.standardize_dtype(grad.dtype)
        var_dtype = keras.backend.standardize_dtype(
            _keras_internals.stored_dtype(variable)
        )
        if grad_dtype != var_dtype and keras.backend.is_float_dtype(var_dtype):
            raise ValueError(
                f"The gradient of variable {variable.path!r} is "
                f"{grad_dtype} but the variable is {var_dtype}; gradients "
                "must have their variable's dtype. Received a "
                f"{grad_dtype} gradient. Take gradients with respect to "
                "the variables themselves (not their autocast reads), or "
                "cast the gradient to the variable's dtype."
            )
