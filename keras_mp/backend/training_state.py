"""Optimizer variable values in the middle of `Model.fit`, on any backend.

Imports nothing from keras_mp.

On TensorFlow (and torch) the variables themselves are updated every step.
The JAX trainer (keras 3.10 - 3.15) instead carries the state through its
jitted step as arrays and writes them back to the variables only at the end
of an epoch or when a callback accesses `Callback.model`; meanwhile the
latest arrays sit in `model._jax_state` with `model._jax_state_synced`
False. Reading them there avoids the write-back of every model variable that
going through `Callback.model` would cost each step.
"""

import keras
import numpy as np
from keras import ops


def _unsynced_optimizer_state(model):
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return None
    return state.get("optimizer_variables")


def latest_values(model, variables):
    """The values of `model.optimizer`'s `variables` after the last step.

    Args:
        model: The model being trained (the callback's `_model`).
        variables: Variables of `model.optimizer`.

    Returns:
        A list of NumPy arrays, one per variable.
    """
    state = _unsynced_optimizer_state(model)
    positions = {}
    if state is not None:
        positions = {id(v): i for i, v in enumerate(model.optimizer.variables)}
    # Only variables outside the carried state are read directly: during an
    # epoch the JAX trainer may have dropped the values of the others.
    # A variable itself, not `v.value`: inside a tf.distribute strategy's
    # scope a MirroredVariable's NumPy conversion fails ("object __array__
    # method not producing an array", TensorFlow 2.21), Keras's does not.
    values = [
        state[positions[id(v)]] if id(v) in positions else v for v in variables
    ]
    return [np.asarray(ops.convert_to_numpy(value)) for value in values]


def assign_once(variables, values):
    """Assigns `values` to `variables` now, once, even inside a traced step.

    An optimizer is often built inside the first traced training step (the
    TensorFlow trainer builds it inside its `tf.function`). Values restored
    from a checkpoint are assigned when it is built; inside a TensorFlow
    trace an assignment would become part of the step and run on every step,
    so it is lifted out of the trace, as variable creation is.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.init_scope():
            for variable, value in zip(variables, values):
                variable.assign(value)
        return
    for variable, value in zip(variables, values):
        variable.assign(value)
