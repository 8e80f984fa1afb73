"""Lookahead: an optimizer wrapper written on the RFC 234 pipeline."""

import numbers

import keras
from keras import ops

from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient
from keras_mp.optimizers.wrapper import OptimizerWrapper


@keras.saving.register_keras_serializable(package="keras_mp")
class Lookahead(OptimizerWrapper):
    """Lookahead (Zhang et al., 2019): fast weights explore, slow ones follow.

    The inner optimizer updates the model ("fast") weights as usual; every
    `sync_period` applied updates the slow weights move `slow_step_size` of
    the way towards them and the fast weights restart from the slow ones.
    Only `build_wrapper` and `apply_updates` are overridden. The sync keys on
    `iterations`, which counts applied updates, and is idempotent, so a step
    skipped by an inner `LossScaleOptimizer` changes nothing.

    Args:
        optimizer: The `keras.optimizers.Optimizer` to wrap.
        sync_period: Applied updates between synchronizations. Defaults to `5`.
        slow_step_size: Fraction of the way the slow weights move.
            Defaults to `0.5`.
        **kwargs: `transform_gradients`, `aggregate_gradients` and `name`,
            as for `OptimizerWrapper`.

    Example:

    >>> opt = keras_mp.optimizers.Lookahead(keras.optimizers.SGD(0.1), 2)
    >>> opt.sync_period
    2
    """

    def __init__(self, optimizer, sync_period=5, slow_step_size=0.5, **kwargs):
        if isinstance(sync_period, bool) or not isinstance(sync_period, int):
            raise TypeError(
                f"`sync_period` must be an int. Received: {sync_period!r}"
            )
        if isinstance(slow_step_size, bool) or not isinstance(
            slow_step_size, numbers.Real
        ):
            raise TypeError(
                "`slow_step_size` must be a number in (0, 1]. Received: "
                f"slow_step_size={slow_step_size!r} (of type "
                f"{type(slow_step_size).__name__})"
            )
        if sync_period < 1 or not 0.0 < slow_step_size <= 1.0:
            raise ValueError(
                "Expected sync_period >= 1 and 0 < slow_step_size <= 1. "
                f"Received: sync_period={sync_period}, "
                f"slow_step_size={slow_step_size}"
            )
        super().__init__(optimizer, **kwargs)
        self.sync_period = sync_period
        self.slow_step_size = float(slow_step_size)

    def build_wrapper(self, var_list):
        # Filled from the model's weights at the first update, not here:
        # `build` may run inside a traced step (TF with XLA) where reading
        # model weights into a new variable's initializer cannot be lifted.
        # None for a variable that overwrites itself with its gradient
        # (Keras's float8 state): interpolating it would corrupt it.
        self._slow_weights = [
            None
            if overwrites_with_gradient(v)
            else self.add_variable_from_reference(v, name="slow")
            for v in var_list
        ]
        self._slow_ready = self.add_variable(
            shape=(), dtype="int32", name="slow_ready"
        )

    def apply_updates(self, grads_and_vars):
        variables = list(
            {
                id(v): v
                for _, v in grads_and_vars
                if not overwrites_with_gradient(v)
            }.values()
        )
        slows = [
            self._slow_weights[self._get_variable_index(v)] for v in variables
        ]
        ready = ops.equal(self._slow_ready.value, 1)
        for variable, slow in zip(variables, slows):
            slow.assign(ops.where(ready, slow.value, variable.value))
        self._slow_ready.assign(1)
        super().apply_updates(grads_and_vars)
        sync = ops.equal(ops.mod(self.iterations, self.sync_period), 0)
        for variable, slow in zip(variables, slows):
            fast_value, slow_value = variable.value, slow.value
            moved = slow_value + self.slow_step_size * (fast_value - slow_value)
            slow.assign(ops.where(sync, moved, slow_value))
            variable.assign(ops.where(sync, moved, fast_value))

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config.update(
            sync_period=self.sync_period, slow_step_size=self.slow_step_size
        )
        return config
