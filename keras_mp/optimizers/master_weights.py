"""Master weights: float32 copies of 16-bit weights that the update runs on.

`MasterWeightsMixin`, a base of `StatePrecisionMixin` (`master_weights=True`):
at build, a float32 master for every bfloat16 or float16 trainable variable
(laid out as its variable), which the inner optimizer builds on and updates
in its place; each step maps the gradients onto the masters and, after the
update, rounds each master into its variable. Imports
`keras_mp._keras_internals`, `keras_mp.backend` and
`optimizers/overwrite_with_gradient.py`; never `optimizers/wrapper.py` or a
module above it.
"""

import warnings

import keras
from keras import ops

from keras_mp import _keras_internals
from keras_mp.backend import gradients as backend_gradients
from keras_mp.optimizers.overwrite_with_gradient import overwrites_with_gradient

# The 16-bit dtypes: of the weights that get masters, and of 16-bit state.
HALF_DTYPES = ("bfloat16", "float16")


class MasterWeightsMixin:
    """Master weights of a wrapper.

    Relies on the wrapper's `_master_weights`, `_master_variables`,
    `_state_precision_variables` and `_weight_decay_exclusions` (set by
    `StatePrecisionMixin._init_state_precision`), `_inner_optimizer` and
    `name`.
    """

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the inner optimizer's weight decay."""
        if self._master_weights:
            # The inner optimizer updates the masters, created at build:
            # the request is passed on for them then.
            self.__dict__["_weight_decay_exclusions"] = (
                list(var_list or []),
                var_names,
            )
        self._inner_optimizer.exclude_from_weight_decay(
            var_list=var_list, var_names=var_names
        )

    def _build_master_weights(self, var_list):
        """Creates the masters; the inner optimizer's variable list, each
        16-bit variable replaced by its master."""
        if not self._master_weights:
            return var_list
        inner_var_list = []
        with keras.name_scope(self.name, caller=self):
            for variable in var_list:
                dtype = keras.backend.standardize_dtype(
                    _keras_internals.stored_dtype(variable)
                )
                if dtype not in HALF_DTYPES or overwrites_with_gradient(
                    variable
                ):
                    inner_var_list.append(variable)
                    continue
                # Laid out as its variable under `keras.distribution`, as
                # the slots built on it then are: a sharded kernel's master
                # is sharded too, not a whole copy on every device.
                master = keras.Variable(
                    "zeros",
                    shape=variable.shape,
                    dtype="float32",
                    trainable=False,
                    name=f"{variable.path.replace('/', '_')}_master",
                    layout=_keras_internals.variable_layout(variable),
                )
                self._master_variables[id(variable)] = master
                self._state_precision_variables.append(master)
                inner_var_list.append(master)
        if not self._master_variables:
            warnings.warn(
                f"master_weights=True on optimizer {self.name!r} has no "
                "effect: none of its trainable variables is bfloat16 or "
                "float16 (mixed policies already keep float32 variables, "
                "which are their own master copy). Received variables of "
                f"dtypes {sorted({str(v.dtype) for v in var_list})}. Drop "
                "master_weights, or build the model under a 16-bit policy "
                'such as keras_mp.Policy("bfloat16").',
                stacklevel=5,
            )
        if self._weight_decay_exclusions is not None:
            excluded, names = self._weight_decay_exclusions
            self._inner_optimizer.exclude_from_weight_decay(
                var_list=[
                    self._master_variables.get(id(v), v) for v in excluded
                ],
                var_names=names,
            )
        return inner_var_list

    def _to_master_weights(self, grads_and_vars):
        """The pairs the inner optimizer updates: float32 gradients of the
        masters.

        A master whose rounded value is not its variable's value starts
        again from the variable: so the masters (created as zeros, whatever
        trace builds them) take the variables' values at the first step, and
        after a variable is assigned from outside (`load_weights`,
        `set_weights`), at the next one.
        """
        pairs = []
        for grad, variable in grads_and_vars:
            master = self._master_variables.get(id(variable))
            if master is None:
                pairs.append((grad, variable))
                continue
            value = variable.value
            kept = ops.equal(ops.cast(master.value, value.dtype), value)
            master.assign(
                ops.where(kept, master.value, ops.cast(value, "float32"))
            )
            if grad is not None:
                grad = backend_gradients.map_gradient(
                    lambda g: ops.cast(g, "float32"), grad
                )
            pairs.append((grad, master))
        return pairs

    def _write_back_master_weights(self, variables):
        for variable in variables:
            master = self._master_variables.get(id(variable))
            if master is not None:
                variable.assign(ops.cast(master.value, variable.dtype))
