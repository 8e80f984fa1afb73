"""Variables that Keras overwrites with their gradient, and the split of them.

Keras's float8 layers keep their scales and amax histories in variables with
`overwrite_with_gradient=True`. The pipeline sets them apart once
(`split_overwritten`); the rest of `keras_mp.optimizers` asks
`overwrites_with_gradient`. Imports nothing from keras_mp.
"""


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
