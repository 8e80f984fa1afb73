"""An optimizer step as `Model.fit` runs it, and the bytes per parameter
of a model's weights and its optimizer's state."""

import numpy as np


def apply_as_fit(optimizer, grads, variables, scale_loss=False):
    """One optimizer step on `grads` as `Model.fit` runs it.

    Stateless on JAX (`stateless_apply` on the variables' values, then the
    results assigned back, as the JAX trainer does), stateful `apply`
    elsewhere. The optimizer is built for `variables` first if it is not.

    Args:
        optimizer: The optimizer.
        grads: One gradient per variable.
        variables: The variables to update.
        scale_loss: Whether `optimizer.scale_loss` runs first, which marks
            `grads` as the gradients of a scaled loss (a LossScaleOptimizer
            then unscales them). Defaults to `False`.
    """
    import keras

    if scale_loss:
        optimizer.scale_loss(1.0)
    if keras.backend.backend() != "jax":
        optimizer.apply(grads, variables)
        return
    if not optimizer.built:
        optimizer.build(variables)
    new_values, new_optimizer_values = optimizer.stateless_apply(
        [v.value for v in optimizer.variables],
        grads,
        [v.value for v in variables],
    )
    for variable, value in zip(variables, new_values):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_optimizer_values):
        variable.assign(value)


def bytes_per_parameter(variables, optimizer):
    """Bytes of weights, optimizer state and master weights per parameter.

    Read from the variables themselves (element count times the size of
    their dtype): `variables` (a model's `weights`, say) for the weights;
    `optimizer.variables` for the state (slots, float8 codes and their
    block scales, step counter, seed state), less the float32 master copies
    of `master_weights` (the optimizer variables named `..._master`),
    counted apart. The parameters are the trainable ones among `variables`.

    Args:
        variables: The model's variables (e.g. `model.weights`).
        optimizer: The optimizer, built.

    Returns:
        A dict with float values for `"weights"`, `"state"` and
        `"masters"`.
    """
    import keras

    def nbytes(group):
        total = 0
        for variable in group:
            dtype = keras.backend.standardize_dtype(variable.dtype)
            itemsize = 2 if dtype in ("bfloat16", "float16") else None
            if itemsize is None:
                itemsize = np.dtype(dtype).itemsize
            total += int(np.prod(variable.shape)) * itemsize
        return total

    params = sum(int(np.prod(v.shape)) for v in variables if v.trainable)
    masters = [v for v in optimizer.variables if v.path.endswith("_master")]
    state = [v for v in optimizer.variables if not v.path.endswith("_master")]
    return {
        "weights": nbytes(variables) / params,
        "state": nbytes(state) / params,
        "masters": nbytes(masters) / params,
    }
