"""Building an `OptimizerWrapper`, and the variables the build makes.

`BuildMixin`, a base of `OptimizerWrapper`. `build` runs once, on the
variables of the first step (or of Keras's own call): the state precision's
variables (the stochastic rounding seed, the float32 masters) first, then
the inner optimizer, on the masters where there are some, then the
wrapper's own variables (`build_wrapper`) and its transforms' state, then
a restore held until the build (`checkpointing.py`). `variables` lists the
inner optimizer's, then the wrapper's own (`_own_variables`).
"""

import keras

from keras_mp import _keras_internals
from keras_mp.backend import collectives
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient


class BuildMixin:
    """The build of an `OptimizerWrapper` and the list of its variables.

    Relies on the wrapper's `_inner_optimizer`, `_transforms`,
    `_unused_base_variables`, `build_wrapper`, `_build_state_precision`
    and `_state_precision_variables` (from `state_precision.py`) and
    `_commit_restore` (from `checkpointing.py`).
    """

    @property
    def variables(self) -> list[keras.Variable]:
        return self._inner_optimizer.variables + self._own_variables()

    def _own_variables(self):
        """Variables this wrapper adds (not the inner optimizer's)."""
        return (
            self._variables[self._unused_base_variables :]
            + self._transforms.variables
            + self._state_precision_variables
        )

    @_keras_internals.no_automatic_dependency_tracking
    def build(self, var_list: list[keras.Variable]) -> None:
        var_list = list(var_list)
        if self.built or not var_list:
            # Nothing to build for no variables: Keras's legacy `.h5` loader
            # calls `build(model._trainable_variables)`, empty for models
            # whose weights live in their layers; built then, the optimizer
            # would have no slots for the real variables.
            return
        collectives.use_distinct_collective_keys()
        inner_var_list = self._build_state_precision(var_list)
        if not self._inner_optimizer.built:
            self._inner_optimizer.build(inner_var_list)
        self._trainable_variables = var_list[:]
        self._trainable_variables_indices = {
            self._var_key(v): i for i, v in enumerate(var_list)
        }
        with keras.name_scope(self.name, caller=self):
            self.build_wrapper(var_list)
            self._transforms.optimizer = self
            # Transforms never see the overwriting variables (see
            # `split_overwritten`), so they keep no state for them.
            self._transforms.build(
                [v for v in var_list if not overwrites_with_gradient(v)]
            )
        self.built = True
        if self.__dict__.get("_pending_restore"):
            self._commit_restore(deferred=True)
