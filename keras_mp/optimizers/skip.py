"""The skip: an optimizer update that runs only where a flag holds.

`update_unless_skipped`, behind `OptimizerWrapper.apply_if`: one way per
backend to leave every model and optimizer variable bit-identical on a
skipped step without reading the flag on the host, and the plain branch
for a flag already read there (PyTorch's default, see
`optimizers/host_skip.py`). Imports `keras_mp.backend` and
`keras_mp._keras_internals`; never `wrapper.py`.
"""

import keras
from keras import ops

from keras_mp import _keras_internals
from keras_mp.backend import gradients as backend_gradients


def update_unless_skipped(optimizer, condition, update, grads_and_vars):
    """Runs `update(grads_and_vars)` only where the scalar bool `condition`
    holds; otherwise every variable it would change, and every variable of
    `optimizer`, keeps its exact value.

    `condition` is a bool tensor, or a Python bool decided on the host
    (PyTorch's eager step only): then the update runs, or nothing does.
    """
    if isinstance(condition, bool):
        if condition:
            _update_on_host(update, grads_and_vars, optimizer)
        return
    if keras.backend.backend() == "tensorflow":
        # The update's inputs go in as an argument, not in a closure:
        # under tf.distribute the condition is taken in cross-replica
        # context, and each replica's update then runs with that
        # replica's gradients (see `cond_update`).
        backend_gradients.cond_update(condition, update, grads_and_vars)
        return
    variables = [v for _, v in grads_and_vars]
    targets = _unique(variables + optimizer.variables)
    if (
        keras.backend.backend() == "torch"
        and not _keras_internals.in_stateless_scope()
    ):
        backups = optimizer.__dict__.get("_skip_backups")
        if backups is None:
            backups = backend_gradients.SkipBackups()
            optimizer.__dict__["_skip_backups"] = backups
        backend_gradients.update_in_place_unless_skipped(
            condition,
            update,
            grads_and_vars,
            targets,
            backups,
        )
        return
    current = [t.value for t in targets]
    if keras.backend.backend() == "jax":
        # `lax.cond`, not a select: XLA's CPU backend does not fuse a
        # select on a scalar predicate into the update's fusions, which
        # made it one more pass over all of the state (the skip cost
        # 1.22x a plain step, against 1.06x with the cond). A GPU gains
        # nothing from a select either: on an H200 the select's step was
        # 1.03x the plain step's and the cond's 1.01x (paired rounds:
        # `benchmarks/gpu/results/h200-2026-11-27-run4`).
        def applied():
            with keras.StatelessScope(
                state_mapping=list(zip(targets, current))
            ) as scope:
                update(grads_and_vars)
            return [scope.get_current_value(t) for t in targets]

        values = ops.cond(condition, applied, lambda: current)
        for target, value in zip(targets, values):
            target.assign(value)
        return
    mapping = list(zip(targets, backend_gradients.copies_for_update(current)))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        update(grads_and_vars)
    for target, old in zip(targets, current):
        target.assign(
            ops.where(condition, scope.get_current_value(target), old)
        )


def _update_on_host(update, grads_and_vars, optimizer):
    """The update of a step decided on the host: in place, or in a
    stateless scope on copies (Keras's PyTorch optimizers update the
    tensors they are given in place even there, and `stateless_apply`'s
    inputs must keep their values)."""
    if not _keras_internals.in_stateless_scope():
        update(grads_and_vars)
        return
    targets = _unique([v for _, v in grads_and_vars] + optimizer.variables)
    current = [t.value for t in targets]
    mapping = list(zip(targets, backend_gradients.copies_for_update(current)))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        update(grads_and_vars)
    for target in targets:
        target.assign(scope.get_current_value(target))


def _unique(variables):
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result
