"""Variables that Keras overwrites with their gradient, and the split of them.

Keras's float8 layers keep their scales and amax histories in variables with
`overwrite_with_gradient=True`. The pipeline sets them apart once
(`split_overwritten`); the rest of `keras_mp.optimizers` asks
`overwrites_with_gradient`. `install_ema_exclusion` keeps them out of
Keras's `use_ema` on every backend, and on JAX lets a `fit` follow one that
ended with the EMA's finalize.
"""

import functools

import keras

from keras_mp import _keras_internals
from keras_mp.backend.torch import versions as torch_versions


def overwrites_with_gradient(variable):
    """Whether `variable` is assigned its "gradient" as it is.

    Keras's float8 layers keep their scales and amax histories in such
    variables (`overwrite_with_gradient=True`): the "gradient" is the new
    value. Nothing may unscale, clip, noise, decay or copy it.
    """
    return bool(getattr(variable, "overwrite_with_gradient", False))


def split_overwritten(grads_and_vars):
    """`(regular pairs, overwriting pairs)`, each in the given order.

    The one place the pipeline sets the overwriting variables apart: they
    skip stages 3 to 5 (aggregated by a cross-replica max instead) and are
    assigned by the innermost Keras optimizer.
    """
    regular, overwritten = [], []
    for pair in grads_and_vars:
        (overwritten if overwrites_with_gradient(pair[1]) else regular).append(
            pair
        )
    return regular, overwritten


def install_ema_exclusion():
    """Keeps Keras's EMA (`use_ema=True`) off overwriting variables.

    Keras builds no moving average for a variable with
    `overwrite_with_gradient` (None in its list), and its base class skips
    those; its TensorFlow and JAX backends then assign every entry anyway:
    "None values not supported" in TensorFlow's overwrite `Cond`, a
    TypeError in JAX's. FP8 statistics carriers and Keras's float8 scales
    and amax histories are such variables. Hooked once on
    `keras.optimizers.Optimizer`, so plain optimizers and the ones inside
    keras_mp's wrappers alike average, overwrite and finalize only the
    other variables; an optimizer class that defines these methods itself
    is left alone. The finalize also gives each weight a buffer apart from
    its average's (`_unshare_buffers`), so that a second `fit` trains on
    JAX. After each update the hook also drops the FP8 codes computed from
    the variables before it (`backend/torch/versions.forget_stale`).
    """
    base = keras.optimizers.Optimizer
    apply = base._backend_apply_gradients
    if getattr(apply, "_keras_mp_hook", False):
        return
    finalize = base.finalize_variable_values

    @functools.wraps(apply)
    def _backend_apply_gradients(self, grads, trainable_variables):
        with _keras_internals.averaged_pairs_only(self):
            result = apply(self, grads, trainable_variables)
        # The FP8 codes of the kernels just written are stale (PyTorch).
        torch_versions.forget_stale(trainable_variables)
        return result

    @functools.wraps(finalize)
    def finalize_variable_values(self, var_list):
        var_list = list(var_list)
        pairs = []
        if self.use_ema and self.built:
            averages = _keras_internals.moving_averages(self)
            if len(averages) == len(var_list):
                # Matched by position, as Keras matches them; a list of
                # another length reaches Keras's own error as it is.
                pairs = [
                    (variable, average)
                    for variable, average in zip(var_list, averages)
                    if average is not None
                ]
                var_list = [variable for variable, _ in pairs]
        with _keras_internals.averaged_pairs_only(self):
            finalize(self, var_list)
        _unshare_buffers(pairs)

    _backend_apply_gradients._keras_mp_hook = True
    base._backend_apply_gradients = _backend_apply_gradients
    base.finalize_variable_values = finalize_variable_values


def _unshare_buffers(pairs):
    """Gives each finalized variable a buffer of its own.

    Eagerly, JAX's `Variable.assign(average)` stores the average's own
    array, so the weight and its average share one buffer. The next `fit`
    donates both to its compiled step, which XLA refuses ("Attempt to
    donate the same buffer twice"); Keras's trainer has already detached
    every variable's value by then, and its `finalize_variable_values`
    ends the `fit` with "'NoneType' object is not callable" (keras 3.15).
    TensorFlow and PyTorch copy on assignment: nothing is shared there.
    """
    for variable, average in pairs:
        if variable.value is average.value:
            variable.assign(keras.ops.copy(average))


install_ema_exclusion()
