"""Hyperparameter delegation from a wrapper to its inner optimizer.

`DelegationMixin`, a base of `OptimizerWrapper`: `learning_rate`,
`iterations` and every hyperparameter of the inner optimizer resolve to the
inner optimizer's, through attribute get, set and `dir()`.
"""

import sys

from keras_mp import _keras_internals

# Hyperparameters that `keras.optimizers.Optimizer.__init__` stores on every
# optimizer; on a wrapper they must resolve to the inner optimizer's values.
BASE_HYPERPARAMETERS = (
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)

# Attributes kept off `dir()`: saving walks `dir()` and would store the inner
# optimizer a second time under its own path, breaking the promise that a
# wrapper's checkpoint has the inner optimizer's layout.
_HIDDEN_FROM_SAVING = (
    "inner_optimizer",
    "_inner_optimizer",
    "_pending_restore",
    "_seed_generator",
)


class DelegationMixin:
    """Delegation of an `OptimizerWrapper` to its `_inner_optimizer`.

    Reads `_inner_optimizer` and `_delegated` (the names to delegate, from
    `hyperparameter_names`) from the instance's `__dict__`.
    """

    @property
    def inner_optimizer(self):
        """The wrapped optimizer."""
        return self._inner_optimizer

    def __getattr__(self, name):
        # Only reached when normal lookup fails.
        inner = self.__dict__.get("_inner_optimizer")
        delegated = self.__dict__.get("_delegated", ())
        if inner is not None and name in delegated:
            return getattr(inner, name)
        hint = ""
        if inner is not None and hasattr(inner, name):
            hint = (
                f" {name!r} belongs to the inner optimizer and is not a "
                "hyperparameter, so the wrapper does not delegate it; use "
                f"`optimizer.inner_optimizer.{name}` if bypassing the wrapper "
                "is intended."
            )
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}.{hint}"
        )

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_delegated", ()) and not hasattr(
            type(self), name
        ):
            setattr(self._inner_optimizer, name, value)
            return
        super().__setattr__(name, value)

    def __dir__(self):
        names = set(super().__dir__()) | set(self._delegated)
        if _keras_internals.called_by_keras_saving(sys._getframe(1)):
            return sorted(names - set(_HIDDEN_FROM_SAVING))
        return sorted(names - {"_inner_optimizer"})

    @property
    def learning_rate(self):
        return self._inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self._inner_optimizer.learning_rate = learning_rate

    @property
    def _learning_rate(self):
        return self._inner_optimizer._learning_rate

    @_learning_rate.setter
    def _learning_rate(self, value):
        # Set once by the base constructor; the inner optimizer's is used.
        pass

    @property
    def iterations(self):
        """Updates applied by the inner optimizer."""
        return self._inner_optimizer.iterations

    @property
    def _iterations(self):
        return self._inner_optimizer._iterations

    @_iterations.setter
    def _iterations(self, value):
        # Set once by the base constructor; the inner optimizer's is used.
        pass

    def _get_current_learning_rate(self):
        return self._inner_optimizer._get_current_learning_rate()


def hyperparameter_names(optimizer):
    """The attribute names a wrapper delegates to `optimizer`."""
    names = set(optimizer.get_config()) - {"name"}
    if isinstance(optimizer, DelegationMixin):
        # A wrapper's own config keys (the nested optimizer, its transforms)
        # are structure, not hyperparameters; what it delegates passes on.
        names -= {"optimizer", "inner_optimizer", "transform_gradients"}
        names -= {"aggregate_gradients"}
        names -= {"state_dtype", "stochastic_rounding", "master_weights"}
        names |= optimizer._delegated
    return frozenset(names)
