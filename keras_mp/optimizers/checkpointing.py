"""Checkpoint restore into a plain Keras optimizer that is not built yet.

Holds `restore_at_build`, which `Model.compile` applies to the Keras
optimizers it keeps unwrapped (float32, mixed_bfloat16). Imports only
`keras_mp.backend` and `keras_mp.optimizers.wrapper`; never `models.py`.
"""

import warnings

import numpy as np

from keras_mp.optimizers import wrapper as wrapper_module


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
    if isinstance(optimizer, wrapper_module.OptimizerWrapper) or (
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
    variables = optimizer.variables
    shapes = [tuple(np.shape(value)) for value in values]
    expected = [tuple(variable.shape) for variable in variables]
    if shapes != expected:
        warnings.warn(
            f"Dropped the state of optimizer {optimizer.name!r} loaded "
            f"before it was built: the checkpoint holds {len(values)} "
            f"variables of shapes {shapes}, the optimizer built for this "
            f"model has {len(variables)} of shapes {expected}. It starts "
            "fresh (iterations 0, empty slots). Load a checkpoint saved "
            "from the same model and optimizer class.",
            stacklevel=4,
        )
        return
    wrapper_module._assign_all(
        variables, values, f"optimizer {optimizer.name!r}'s checkpoint"
    )
