"""OptimizerWrapper: delegation to an inner optimizer and the RFC 234 pipeline."""

import sys
import warnings
import weakref

import keras
import numpy as np
from keras import ops

from keras_mp import _config
from keras_mp import _keras_internals
from keras_mp import transforms as transforms_module
from keras_mp.backend import collectives
from keras_mp.backend import gradients as backend_gradients
from keras_mp.backend import training_state

# Hyperparameters that `keras.optimizers.Optimizer.__init__` stores on every
# optimizer; on a wrapper they must resolve to the inner optimizer's values.
_BASE_HYPERPARAMETERS = (
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
)


class _WrapperState(_keras_internals.KerasSaveable):
    """The variables a chain of wrappers adds, saved beside the inner layout.

    The wrapper's own `vars` entry holds exactly what the innermost Keras
    optimizer would save, so a plain optimizer reads it; this object saves
    the rest (loss scale, transform state) under a path of its own, which a
    plain optimizer never visits. A checkpoint without it (one written by a
    plain optimizer) leaves these variables at their current values.

    Keras loads the wrapper's own entry, then this one; the wrapper restores
    both together (see `OptimizerWrapper._restore`).
    """

    def __init__(self, wrapper):
        # A weak reference: saving walks attributes, and a strong one would
        # lead it back to the wrapper in a cycle.
        self._wrapper_ref = weakref.ref(wrapper)

    def _obj_type(self):
        return "Optimizer"

    def _variables(self):
        return self._wrapper_ref()._wrapper_variables()

    def save_own_variables(self, store):
        for i, variable in enumerate(self._variables()):
            store[str(i)] = keras.ops.convert_to_numpy(variable.value)

    def load_own_variables(self, store):
        self._wrapper_ref()._restore(wrapper_values=_read_store(store))


def _read_store(store):
    """The values of a weights-store entry, in order, as numpy arrays."""
    return [np.array(store[str(i)]) for i in range(len(store.keys()))]


def _assign_all(variables, values, what):
    """Assigns every value or none: count and shapes are checked first."""
    if len(values) != len(variables):
        raise ValueError(
            f"Expected {len(variables)} values for {what} "
            f"({[v.path for v in variables]}). Received {len(values)}. "
            "Nothing was loaded or assigned. Use values saved from an optimizer "
            "wrapped and built the same way (same inner optimizer, loss "
            "scale kind, transforms and trainable variables)."
        )
    for variable, value in zip(variables, values):
        if tuple(variable.shape) != tuple(np.shape(value)):
            raise ValueError(
                f"Cannot assign a value of shape {tuple(np.shape(value))} to "
                f"variable {variable.path!r} of shape "
                f"{tuple(variable.shape)} ({what}). Nothing was loaded or "
                "assigned."
            )
    training_state.assign_once(variables, values)


@keras.saving.register_keras_serializable(package="keras_mp")
class OptimizerWrapper(keras.optimizers.Optimizer):
    """An optimizer that wraps another and runs the RFC 234 pipeline.

    Training loops call `minimize`, or `scale_loss` then `apply`/
    `apply_gradients`/`stateless_apply` as `Model.fit` does, and never need
    to know how the optimizer scales, aggregates, clips or transforms.
    Every step runs six stages, each a public method to override:

    1. `transform_loss(loss)`: e.g. scale the loss.
    2. `get_gradients(loss, variables, tape)`: differentiate.
    3. `transform_unaggregated_gradients(grads_and_vars)`: per replica.
    4. `aggregate_gradients(grads_and_vars)`: sum across replicas.
    5. `transform_gradients(grads_and_vars)`: e.g. clip; runs the
       `transform_gradients` plug-ins.
    6. `apply_updates(grads_and_vars)`: the inner optimizer's update.

    The wrapper delegates to `inner_optimizer`: `learning_rate` (get and
    set), `iterations`, `variables` (the inner optimizer's, followed by the
    wrapper's own), and every hyperparameter of the inner optimizer (every
    `get_config()` key but `name`) through attribute get, set and `dir()`.
    Other attributes of the inner optimizer raise AttributeError, so a custom
    method can never silently bypass the wrapper.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap, as in
            `keras_mp.LossScaleOptimizer` and Keras. (`optimizer=` works
            too, the name of earlier releases.)
        transform_gradients: Gradient transforms run in stage 5, in order:
            `keras_mp.transforms` instances, registered names, `(name,
            config)` pairs or plain callables taking and returning
            `grads_and_vars`. Defaults to `None`.
        aggregate_gradients: Callable taking and returning `grads_and_vars`
            that replaces the default cross-replica sum of stage 4.
            Defaults to `None`.
        name: Name of the wrapper. Defaults to the class name.

    Example:

    >>> opt = keras_mp.OptimizerWrapper(
    ...     keras.optimizers.SGD(0.1, momentum=0.9),
    ...     transform_gradients=["clip_by_global_norm"],
    ... )
    >>> float(opt.momentum)
    0.9
    >>> opt.momentum = 0.5
    >>> float(opt.inner_optimizer.momentum)
    0.5
    """

    def __init__(
        self,
        inner_optimizer=None,
        transform_gradients=None,
        aggregate_gradients=None,
        name=None,
        **kwargs,
    ):
        if "optimizer" in kwargs:
            if inner_optimizer is not None:
                raise TypeError(
                    "Pass the optimizer to wrap once, as `inner_optimizer`. "
                    f"Received: inner_optimizer={inner_optimizer!r} and "
                    f"optimizer={kwargs['optimizer']!r}"
                )
            inner_optimizer = kwargs.pop("optimizer")
        optimizer = inner_optimizer
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a keras.optimizers.Optimizer. "
                f"Received: inner_optimizer={optimizer!r} (of type "
                f"{type(optimizer).__name__}). Pass e.g. "
                "keras.optimizers.Adam(1e-3)."
            )
        owner = getattr(optimizer, "_keras_mp_wrapped_by", None)
        if owner is not None:
            raise ValueError(
                f"The optimizer {optimizer.name!r} is already wrapped by "
                f"{owner!r}; two wrappers cannot share one inner optimizer. "
                "Wrap a fresh optimizer, or wrap the existing wrapper."
            )
        if aggregate_gradients is not None and not callable(
            aggregate_gradients
        ):
            raise TypeError(
                "`aggregate_gradients` must be a callable taking and returning "
                f"grads_and_vars. Received: {aggregate_gradients!r}"
            )
        # The base class is initialized directly: with LossScaleOptimizer,
        # the next class in the MRO is Keras's LossScaleOptimizer, whose
        # constructor must not run.
        keras.optimizers.Optimizer.__init__(
            self, learning_rate=0.0, name=name, **kwargs
        )
        # The base constructor made a learning rate and an iteration counter;
        # a wrapper uses the inner optimizer's, and stores the hyperparameters
        # there too.
        self._variables.clear()
        for key in _BASE_HYPERPARAMETERS:
            self.__dict__.pop(key, None)
        self._inner_optimizer = optimizer
        optimizer._keras_mp_wrapped_by = self.name
        self._delegated = _hyperparameter_names(optimizer)
        self._transforms = transforms_module.Chain(transform_gradients or [])
        self._aggregate_gradients_fn = aggregate_gradients
        self._keras_mp_state = _WrapperState(self)
        self._unscaled_gradients = []

    # ----------------------------------------------------------- delegation
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

    @property
    def transforms(self):
        """The `keras_mp.transforms.Chain` run by `transform_gradients`."""
        return self._transforms

    @property
    def variables(self):
        return self._inner_optimizer.variables + self._own_variables()

    def _own_variables(self):
        """Variables this wrapper adds (not the inner optimizer's)."""
        return self._variables[:] + self._transforms.variables

    def _wrapper_variables(self):
        inner = self._inner_optimizer
        below = inner._wrapper_variables() if _is_wrapper(inner) else []
        return below + self._own_variables()

    def _base_optimizer(self):
        inner = self._inner_optimizer
        return inner._base_optimizer() if _is_wrapper(inner) else inner

    def save_own_variables(self, store):
        self._base_optimizer().save_own_variables(store)

    def load_own_variables(self, store):
        self._restore(inner_values=_read_store(store))

    def _restore(self, inner_values=None, wrapper_values=None):
        """Restores checkpointed state, all of it or none.

        Keras's loader calls `load_own_variables` (the inner optimizer's
        layout) and then `_WrapperState.load_own_variables` (the wrapper's
        own variables, an empty entry in a plain optimizer's checkpoint).
        The first is held until the second arrives, so a mismatch in either
        leaves every variable as it was. Into an optimizer that is not built
        yet (a fresh model compiled, then `load_weights`), the values are
        kept until `build` creates the variables, so training resumes where
        it stopped instead of from a fresh optimizer state.
        """
        if inner_values is not None:
            self.__dict__["_pending_restore"] = {"inner": inner_values}
            return
        pending = self.__dict__.setdefault("_pending_restore", {})
        pending["wrapper"] = wrapper_values
        if self.built:
            self._commit_restore()

    def _commit_restore(self):
        pending = self.__dict__.pop("_pending_restore", None) or {}
        if "weights" in pending:
            _assign_all(
                self.variables,
                pending["weights"],
                f"optimizer {self.name!r}'s weights",
            )
            return
        variables, values = [], []
        inner_values = pending.get("inner")
        if inner_values is not None:
            inner_variables = self._base_optimizer().variables
            if len(inner_values) != len(inner_variables):
                # As Keras does for a plain optimizer: the checkpoint of an
                # optimizer built for other variables (or not built) is
                # skipped with a warning.
                warnings.warn(
                    f"Skipping variable loading for optimizer {self.name!r}: "
                    f"the checkpoint holds {len(inner_values)} variables of "
                    f"the inner optimizer, which has {len(inner_variables)}. "
                    "It was likely saved before the optimizer was built "
                    "(before the first training step), or for other "
                    "trainable variables.",
                    stacklevel=3,
                )
                return
            variables += inner_variables
            values += inner_values
        wrapper_values = pending.get("wrapper")
        if wrapper_values:
            variables += self._wrapper_variables()
            values += wrapper_values
        _assign_all(variables, values, f"optimizer {self.name!r}'s checkpoint")

    def get_weights(self):
        """The values of `variables`, as numpy arrays, in the same order."""
        return [ops.convert_to_numpy(v.value) for v in self.variables]

    def set_weights(self, weights):
        """Assigns `get_weights()`'s output of an optimizer built the same way.

        The values follow the order of `variables` (the inner optimizer's,
        then the wrapper's own). Count and shapes are checked before any
        assignment, so a mismatch leaves every variable as it was. On an
        optimizer that is not built yet (as Keras's legacy `.h5` loader
        finds it), the values are assigned when `build` creates the
        variables, and a mismatch is reported then.
        """
        weights = [np.asarray(w) for w in weights]
        if not self.built:
            self.__dict__["_pending_restore"] = {"weights": weights}
            return
        _assign_all(
            self.variables, list(weights), f"optimizer {self.name!r}'s weights"
        )

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from the inner optimizer's weight decay."""
        self._inner_optimizer.exclude_from_weight_decay(
            var_list=var_list, var_names=var_names
        )

    def finalize_variable_values(self, var_list):
        self._inner_optimizer.finalize_variable_values(var_list)

    # ---------------------------------------------------------------- build
    @_keras_internals.no_automatic_dependency_tracking
    def build(self, var_list):
        var_list = list(var_list)
        if self.built or not var_list:
            # Nothing to build for no variables: Keras's legacy `.h5` loader
            # calls `build(model._trainable_variables)`, empty for models
            # whose weights live in their layers; built then, the optimizer
            # would have no slots for the real variables.
            return
        collectives.use_distinct_collective_keys()
        if not self._inner_optimizer.built:
            self._inner_optimizer.build(var_list)
        self._trainable_variables = var_list[:]
        self._trainable_variables_indices = {
            self._var_key(v): i for i, v in enumerate(var_list)
        }
        with keras.name_scope(self.name, caller=self):
            self.build_wrapper(var_list)
            self._transforms.optimizer = self
            self._transforms.build(var_list)
        self.built = True
        if self.__dict__.get("_pending_restore"):
            self._commit_restore()

    def build_wrapper(self, var_list):
        """Creates the wrapper's own variables with `self.add_variable`.

        Called once by `build`, after the inner optimizer is built. Override
        in subclasses that keep state; the default creates nothing.
        """

    # ------------------------------------------------------------- pipeline
    def transform_loss(self, loss):
        """Stage 1: transforms the loss before differentiation.

        The default defers to the inner optimizer (`scale_loss`).
        """
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            return inner.transform_loss(loss)
        return inner.scale_loss(loss)

    def get_gradients(self, loss, variables, tape=None):
        """Stage 2: gradients of the (transformed) loss.

        Args:
            loss: A scalar tensor recorded by `tape` (TensorFlow), or a
                zero-argument callable (any backend).
            variables: The variables to differentiate against.
            tape: A `tf.GradientTape` (TensorFlow only).

        Returns:
            A list of `(gradient, variable)` pairs.
        """
        variables = list(variables)
        grads = backend_gradients.compute_gradients(loss, variables, tape)
        return list(zip(grads, variables))

    def transform_unaggregated_gradients(self, grads_and_vars):
        """Stage 3: transforms each replica's gradients before aggregation.

        The default defers to an inner wrapper, and is the identity otherwise.
        """
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            return inner.transform_unaggregated_gradients(grads_and_vars)
        return grads_and_vars

    def aggregate_gradients(self, grads_and_vars):
        """Stage 4: sums gradients across replicas (identity on one device).

        Uses the `aggregate_gradients` constructor argument if given, else
        defers to an inner wrapper (whose own stages 3-4 are then skipped),
        else sums across tf.distribute replicas.
        """
        if self._aggregate_gradients_fn is not None:
            return list(self._aggregate_gradients_fn(grads_and_vars))
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            return inner.aggregate_gradients(grads_and_vars)
        grads = backend_gradients.all_reduce_sum([g for g, _ in grads_and_vars])
        return list(zip(grads, [v for _, v in grads_and_vars]))

    def transform_gradients(self, grads_and_vars):
        """Stage 5: transforms aggregated gradients with the plug-in chain."""
        return self._transforms(grads_and_vars)

    def apply_updates(self, grads_and_vars):
        """Stage 6: the inner optimizer updates the variables."""
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            inner.apply_gradients(
                grads_and_vars, skip_gradients_aggregation=True
            )
            return
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        backend_gradients.apply_aggregated(inner, grads, variables)

    # --------------------------------------------------------- entry points
    def compute_gradients(self, loss, var_list, tape=None):
        """Stages 1-2: transformed loss, then its gradients.

        Returns:
            A list of `(gradient, variable)` pairs, ready for
            `apply_gradients`.
        """
        loss = transformed_loss(self.transform_loss, loss, tape)
        return self.get_gradients(loss, list(var_list), tape)

    def minimize(self, loss, var_list, tape=None):
        """Runs the whole pipeline: the loss's gradients update `var_list`.

        Args:
            loss: A scalar tensor recorded by `tape` (TensorFlow), or a
                zero-argument callable returning the loss (any backend).
            var_list: The variables to train.
            tape: The `tf.GradientTape` that recorded `loss` (TensorFlow).

        Returns:
            The `iterations` variable.
        """
        grads_and_vars = self.compute_gradients(loss, var_list, tape=tape)
        return self.apply_gradients(grads_and_vars)

    def scale_loss(self, loss):
        """Keras 3's name for stage 1, called by `Model.fit`."""
        return self.transform_loss(loss)

    def apply(self, grads, trainable_variables=None):
        """Stages 3-6 for gradients of `trainable_variables` (Keras 3 API)."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        self.apply_gradients(zip(grads, trainable_variables))

    def apply_gradients(self, grads_and_vars, skip_gradients_aggregation=False):
        """Stages 3-6.

        Args:
            grads_and_vars: Iterable of `(gradient, variable)` pairs.
            skip_gradients_aggregation: If True, stages 3-4 are skipped, for
                gradients that are already aggregated. Defaults to `False`.

        Returns:
            The `iterations` variable.
        """
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        if not grads_and_vars:
            return self.iterations
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build([v for _, v in grads_and_vars])
        self._check_gradient_dtypes(grads_and_vars)
        if not skip_gradients_aggregation:
            grads_and_vars = self.transform_unaggregated_gradients(
                grads_and_vars
            )
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
        self.run_step(grads_and_vars)
        return self.iterations

    def run_step(self, grads_and_vars):
        """Stages 5-6 on aggregated gradients.

        Subclasses that may skip a step (as `LossScaleOptimizer` does on
        overflow) override this and call `apply_if(condition, ...)`.
        """
        self._transform_and_apply(grads_and_vars)

    def _transform_and_apply(self, grads_and_vars):
        self.apply_updates(self.transform_gradients(grads_and_vars))

    def apply_if(self, condition, grads_and_vars):
        """Runs stages 5-6 only where the scalar bool `condition` holds.

        On a skipped step every model and optimizer variable keeps its exact
        value, and the condition never becomes a Python bool (no host sync).
        Inside TensorFlow graphs the update runs in a `tf.cond` branch. On
        PyTorch the update runs in place and each variable is then selected
        between its new and its saved value on the device. Elsewhere (JAX,
        and any stateless scope) the update runs in a stateless scope and
        each variable is assigned `where(condition, new, old)`: under
        `jax.jit` the select fuses with the update's last elementwise op,
        where a `cond` would keep the compiler from fusing across it. This
        also works in `stateless_apply`.
        """
        if keras.backend.backend() == "tensorflow":
            # The update's inputs go in as an argument, not in a closure:
            # under tf.distribute the condition is taken in cross-replica
            # context, and each replica's update then runs with that
            # replica's gradients (see `cond_update`).
            backend_gradients.cond_update(
                condition, self._transform_and_apply, grads_and_vars
            )
            return
        variables = [v for _, v in grads_and_vars]
        targets = _unique(variables + self.variables)
        if (
            keras.backend.backend() == "torch"
            and not _keras_internals.in_stateless_scope()
        ):
            backend_gradients.update_in_place_unless_skipped(
                condition, self._transform_and_apply, grads_and_vars, targets
            )
            return
        current = [t.value for t in targets]
        mapping = list(
            zip(targets, backend_gradients.copies_for_update(current))
        )
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._transform_and_apply(grads_and_vars)
        for target, old in zip(targets, current):
            target.assign(
                ops.where(condition, scope.get_current_value(target), old)
            )

    def _check_gradient_dtypes(self, grads_and_vars):
        for grad, variable in grads_and_vars:
            if grad is None:
                continue
            grad_dtype = keras.backend.standardize_dtype(grad.dtype)
            var_dtype = keras.backend.standardize_dtype(
                _keras_internals.stored_dtype(variable)
            )
            if grad_dtype != var_dtype and keras.backend.is_float_dtype(
                var_dtype
            ):
                raise ValueError(
                    f"The gradient of variable {variable.path!r} is "
                    f"{grad_dtype} but the variable is {var_dtype}; gradients "
                    "must have their variable's dtype. Received a "
                    f"{grad_dtype} gradient. Take gradients with respect to "
                    "the variables themselves (not their autocast reads), or "
                    "cast the gradient to the variable's dtype."
                )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        return keras.optimizers.Optimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables
        )

    # -------------------------------------------------------- serialization
    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(
                self._inner_optimizer
            ),
            "transform_gradients": self._transforms.get_config()["transforms"]
            or None,
            "aggregate_gradients": None,
        }
        if self._aggregate_gradients_fn is not None:
            config["aggregate_gradients"] = keras.saving.serialize_keras_object(
                self._aggregate_gradients_fn
            )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        _config.check_config(cls, config, required=("optimizer",))
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        if config.get("aggregate_gradients") is not None:
            config["aggregate_gradients"] = (
                keras.saving.deserialize_keras_object(
                    config["aggregate_gradients"], custom_objects=custom_objects
                )
            )
        return cls(optimizer, **config)

    def get_state(self):
        """The plug-in state of this wrapper: `{name: numpy array}`."""
        return self._transforms.get_state()

    def set_state(self, state):
        """Restores `get_state()`'s output; all or nothing on a mismatch."""
        self._transforms.set_state(state)


def transformed_loss(transform, loss, tape=None):
    """`transform(loss)`, for a loss given as a tensor or as a callable.

    A callable loss gives a callable (gradients are taken by calling it);
    a tensor recorded by `tape` is transformed inside the tape, re-entered
    (tf.keras did the same), so that the gradient flows through the
    transformation.
    """
    if callable(loss):
        return lambda: transform(loss())
    if tape is not None:
        with tape:
            return transform(loss)
    return transform(loss)


def _hyperparameter_names(optimizer):
    """The attribute names a wrapper delegates to `optimizer`."""
    names = set(optimizer.get_config()) - {"name"}
    if _is_wrapper(optimizer):
        # A wrapper's own config keys (the nested optimizer, its transforms)
        # are structure, not hyperparameters; what it delegates passes on.
        names -= {"optimizer", "inner_optimizer", "transform_gradients"}
        names -= {"aggregate_gradients"}
        names |= optimizer._delegated
    return frozenset(names)


def _is_wrapper(optimizer):
    return isinstance(optimizer, OptimizerWrapper)


def _unique(variables):
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result
