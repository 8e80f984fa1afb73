"""OptimizerWrapper: delegation to an inner optimizer and the RFC 234 pipeline."""

import random
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
from keras_mp.backend import optimizer_state
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
    "_seed_generator",
)

# The dtypes `state_dtype` takes. float16 state only suits slots that stay
# within its range (it flushes Adam's squared gradients below 6e-8 to zero);
# bfloat16 has float32's range.
_STATE_DTYPES = ("bfloat16", "float16", "float32")
_HALF_DTYPES = ("bfloat16", "float16")


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
    training_state.assign_once(
        variables, _converted_to_variable_dtypes(variables, values, what)
    )


def _converted_to_variable_dtypes(variables, values, what):
    """`values` in their variables' float dtypes, with a warning naming every
    conversion: a checkpoint's arrays carry the dtype they were saved in, so
    float32 optimizer state loads into bfloat16 state (rounded to nearest)
    and back (exact), and neither happens silently."""
    converted, conversions = [], {}
    for variable, value in zip(variables, values):
        value = np.asarray(value)
        source = keras.backend.standardize_dtype(value.dtype)
        target = keras.backend.standardize_dtype(
            _keras_internals.stored_dtype(variable)
        )
        if (
            source != target
            and keras.backend.is_float_dtype(source)
            and keras.backend.is_float_dtype(target)
        ):
            conversions.setdefault((source, target), []).append(variable.path)
            # In NumPy: this may run while a TensorFlow step is traced.
            value = value.astype(_numpy_dtype(target))
        converted.append(value)
    for (source, target), paths in conversions.items():
        lossy = any(
            a < b
            for a, b in zip(
                _FLOAT_BITS[target], _FLOAT_BITS.get(source, (99, 99))
            )
        )
        how = "rounded to nearest" if lossy else "exactly"
        warnings.warn(
            f"Converted {len(paths)} value(s) from {source} to {target} "
            f"({how}) while loading {what}: the checkpoint holds {source} "
            f"values for {target} variables ({', '.join(paths[:3])}"
            f"{', ...' if len(paths) > 3 else ''}). This is expected when "
            "optimizer state saved with another `state_dtype` is loaded.",
            stacklevel=4,
        )
    return converted


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


# (mantissa bits, exponent bits): a conversion is exact where neither shrinks.
_FLOAT_BITS = {
    "float16": (10, 5),
    "bfloat16": (7, 8),
    "float32": (23, 8),
    "float64": (52, 11),
}


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
        state_dtype: Dtype of the inner optimizer's slot variables (Adam's
            moments, SGD's momentum, RMSprop's accumulators: every variable
            it creates from a trainable variable), `"bfloat16"`,
            `"float16"` or `"float32"`; `None` keeps the trainable
            variable's dtype, as Keras does. For float32 (or masters')
            variables each update still computes in float32: the slot is
            read upcast and the result stored rounded. For bfloat16 or
            float16 variables without `master_weights`, Keras's update
            math runs in the variable's dtype (Adam's `beta_2=0.999`
            rounds to 1.0 in bfloat16 and the weights never move): use
            `master_weights=True` there.
            `"bfloat16"` halves float32 Adam's 8 bytes of state per
            parameter. Defaults to `None`.
        stochastic_rounding: Whether bfloat16 state is stored with
            stochastic rounding (unbiased: increments smaller than the
            rounding step survive on average, where rounding to nearest
            would drop them every step). The random bits come from a
            `keras.random.SeedGenerator` whose state is an optimizer
            variable and whose seed is drawn when the wrapper is created,
            so runs repeat after `keras.utils.set_random_seed`.
            `None` means True for bfloat16 state, False otherwise; only
            bfloat16 state supports it. Defaults to `None`.
        master_weights: Whether to keep a float32 master copy of every
            bfloat16 or float16 trainable variable ("pure 16-bit" training,
            e.g. under `keras_mp.Policy("bfloat16")`): the inner optimizer
            updates the masters (so its slots follow the masters' dtype)
            and each variable receives its master rounded to nearest, so
            updates smaller than the variable's precision still add up.
            The masters are optimizer variables, checkpointed after the
            inner optimizer's. A variable assigned from outside (e.g.
            `load_weights`) is picked up at the next step. Warns at build
            when no trainable variable is 16-bit. Defaults to `False`.

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

    Adam's moments in bfloat16 (half the memory), updated in float32:

    >>> opt = keras_mp.OptimizerWrapper(
    ...     keras.optimizers.Adam(), state_dtype="bfloat16"
    ... )
    >>> opt.build([keras.Variable([1.0, 2.0])])
    >>> [str(v.dtype) for v in opt.inner_optimizer.variables[2:]]
    ['bfloat16', 'bfloat16']
    """

    def __init__(
        self,
        inner_optimizer=None,
        transform_gradients=None,
        aggregate_gradients=None,
        name=None,
        state_dtype=None,
        stochastic_rounding=None,
        master_weights=False,
        **kwargs,
    ):
        state_dtype, stochastic_rounding = _check_state_arguments(
            state_dtype, stochastic_rounding, master_weights
        )
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
        _check_state_precision_target(
            optimizer, state_dtype, master_weights, name
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
        self._init_state_precision(
            state_dtype, stochastic_rounding, master_weights
        )

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
        return (
            self._variables[:]
            + self._transforms.variables
            + self._state_precision_variables
        )

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
        it stopped instead of from a fresh optimizer state; kept values that
        do not fit the variables built then (the rest of that load failed)
        are skipped with a warning.
        """
        if inner_values is not None:
            self.__dict__["_pending_restore"] = {"inner": inner_values}
            return
        pending = self.__dict__.setdefault("_pending_restore", {})
        pending["wrapper"] = wrapper_values
        if self.built:
            self._commit_restore()

    def _commit_restore(self, deferred=False):
        pending = self.__dict__.pop("_pending_restore", None) or {}
        if deferred and "weights" not in pending:
            # Held since a `load_weights` into this unbuilt optimizer, which
            # may have failed as a whole (Keras reports a layer's mismatch
            # after loading every object): a checkpoint that does not fit
            # the variables now built is skipped, as Keras skips an unbuilt
            # optimizer's, instead of failing this first training step.
            try:
                self._commit_checkpoint(pending)
            except ValueError as error:
                warnings.warn(
                    f"Skipping the optimizer state loaded into {self.name!r} "
                    "before it was built: it does not fit the variables it "
                    f"was built for ({error}) The optimizer starts fresh. "
                    "Load a checkpoint saved from the same model and "
                    "optimizer.",
                    stacklevel=3,
                )
            return
        if "weights" in pending:
            _assign_all(
                self.variables,
                pending["weights"],
                f"optimizer {self.name!r}'s weights",
            )
            return
        self._commit_checkpoint(pending)

    def _commit_checkpoint(self, pending):
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
            wrapper_variables, wrapper_values = self._matching_state_precision(
                self._wrapper_variables(), wrapper_values
            )
            variables += wrapper_variables
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

    # ------------------------------------------------------ state precision
    def _init_state_precision(
        self, state_dtype, stochastic_rounding, master_weights
    ):
        # Plain containers, set past Keras's attribute tracking, which
        # would also list the variables they hold in `self._variables`.
        self.__dict__.update(
            _state_dtype=state_dtype,
            _stochastic_rounding=stochastic_rounding,
            _master_weights=master_weights,
            _state_precision_variables=[],
            _master_variables={},
            _weight_decay_exclusions=None,
            # Drawn now, as Keras layers draw theirs, not at build: after
            # `keras.utils.set_random_seed`, an optimizer created alike
            # rounds alike however many others are built before it trains.
            _stochastic_rounding_seed=(
                random.randint(1, int(1e9)) if stochastic_rounding else None
            ),
        )
        if state_dtype is not None:
            self._install_state_dtype(self._base_optimizer())

    def _install_state_dtype(self, base):
        """Hooks the base optimizer's slot creation and slot stores.

        Keras optimizers create their slots with `add_variable_from_reference`,
        update each variable in `update_step` and store with
        `self.assign`/`assign_add`/`assign_sub`. The hooks, set on this
        instance only, create slots in `state_dtype`, run `update_step` for
        a float32 variable in a float32 autocast scope (so every read of a
        slot is upcast and the update's math is float32), and compute each
        slot store in float32, rounding once at the end.
        """
        state_dtype = self._state_dtype
        slot_ids = set()
        create_from_reference = base.add_variable_from_reference
        create = base.add_variable
        # Set while `add_variable_from_reference` creates a slot, whose
        # `add_variable` call then gets the state dtype.
        creating_slot = []

        def add_variable_from_reference(
            reference_variable, name=None, initializer="zeros"
        ):
            if (
                name in _keras_internals.NON_STATE_SLOT_NAMES
                or not keras.backend.is_float_dtype(reference_variable.dtype)
                or overwrites_with_gradient(reference_variable)
            ):
                return create_from_reference(
                    reference_variable, name, initializer
                )
            creating_slot.append(True)
            try:
                slot = create_from_reference(
                    reference_variable, name, initializer
                )
            finally:
                creating_slot.pop()
            slot_ids.add(id(slot))
            return slot

        def add_variable(*args, **kwargs):
            if creating_slot:
                kwargs["dtype"] = state_dtype
            return create(*args, **kwargs)

        base.__dict__["add_variable_from_reference"] = (
            add_variable_from_reference
        )
        base.__dict__["add_variable"] = add_variable
        if state_dtype not in _HALF_DTYPES:
            # float32 slots store the float32 result as it is. Torch's bulk
            # updates could not store into slots of another dtype than the
            # variable's.
            optimizer_state.route_updates_through_update_step(base)
            return
        assign = base.assign
        round_state = self._round_state

        def store(combine):
            def hooked(variable, value):
                if id(variable) in slot_ids:
                    value = round_state(combine(variable, value))
                    target = assign
                else:
                    target = combine.original
                # Stored outside the float32 scope: the backend's store reads
                # the variable itself, not an upcast copy of it.
                with _keras_internals.without_autocast():
                    return target(variable, value)

            return hooked

        update_step = base.update_step

        def hooked_update_step(gradient, variable, learning_rate):
            if keras.backend.standardize_dtype(variable.dtype) != "float32":
                # A 16-bit variable's update stays in its dtype, as Keras
                # computes it; `master_weights` gives it float32 math.
                return update_step(gradient, variable, learning_rate)
            with _keras_internals.AutocastScope("float32"):
                return update_step(gradient, variable, learning_rate)

        base.__dict__["update_step"] = hooked_update_step
        # Torch's bulk updates could not store into slots of another dtype
        # than the variable's, nor round them: the update goes through
        # `update_step` and the hooks below, or on PyTorch, for Keras's
        # Adam, AdamW, SGD and RMSprop, through the same update fused into
        # a few in-place calls per batch of elements.
        optimizer_state.route_updates_through_update_step(
            base,
            optimizer_state.FusedStateUpdate(
                base,
                state_dtype,
                self._stochastic_rounding,
                seed_generator=lambda: self._seed_generator,
                update_step=hooked_update_step,
            )
            if keras.backend.backend() == "torch"
            else None,
        )
        # Without XLA, TensorFlow runs each cast of a slot (read upcast,
        # store rounded) as a kernel pass of its own.
        optimizer_state.compile_update_with_xla(base)

        for name, combine in (
            ("assign", lambda variable, value: ops.cast(value, "float32")),
            (
                "assign_add",
                lambda variable, value: ops.add(
                    ops.cast(variable, "float32"), ops.cast(value, "float32")
                ),
            ),
            (
                "assign_sub",
                lambda variable, value: ops.subtract(
                    ops.cast(variable, "float32"), ops.cast(value, "float32")
                ),
            ),
        ):
            combine.original = getattr(base, name)
            base.__dict__[name] = store(combine)

    def _round_state(self, value):
        """A float32 `value` stored in `state_dtype`."""
        if self._stochastic_rounding:
            return stochastic_round_to_bfloat16(value, self._seed_generator)
        return ops.cast(value, self._state_dtype)

    def _build_state_precision(self, var_list):
        """Creates the seed state and the masters; the inner optimizer's list.

        Called by `build` before the inner optimizer is built, which then
        builds on the masters in place of their variables.
        """
        if self._stochastic_rounding:
            self._seed_generator = keras.random.SeedGenerator(
                seed=self._stochastic_rounding_seed, name="stochastic_rounding"
            )
            self._state_precision_variables.append(self._seed_generator.state)
        if not self._master_weights:
            return var_list
        inner_var_list = []
        with keras.name_scope(self.name, caller=self):
            for variable in var_list:
                dtype = keras.backend.standardize_dtype(
                    _keras_internals.stored_dtype(variable)
                )
                if dtype not in _HALF_DTYPES or overwrites_with_gradient(
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
                stacklevel=4,
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

    def _matching_state_precision(self, variables, values):
        """The wrapper variables and checkpoint values to assign, when the
        checkpoint was written with other state precision settings.

        The seed state of stochastic rounding and the masters come last.
        A checkpoint without them (saved without stochastic rounding or
        master weights) leaves them as they are: the masters start again
        from the variables at the next step. A checkpoint with them, loaded
        where they do not exist, has its trailing values dropped. Both warn.
        """
        extra = len(self._state_precision_variables)
        if len(values) == len(variables) or not (
            extra or _saved_state_precision(values[len(variables) :])
        ):
            return variables, values
        if extra and len(values) == len(variables) - extra:
            warnings.warn(
                f"The checkpoint loaded into optimizer {self.name!r} holds no "
                "stochastic rounding seed or master weights: they keep their "
                "current values (masters follow the variables at the next "
                "step).",
                stacklevel=5,
            )
            return variables[: len(values)], values
        if not extra and len(values) > len(variables):
            warnings.warn(
                f"Dropped {len(values) - len(variables)} value(s) of the "
                f"checkpoint loaded into optimizer {self.name!r}: the "
                "stochastic rounding seed and master weights of an optimizer "
                "saved with state_dtype/master_weights, which this one does "
                "not use.",
                stacklevel=5,
            )
            return variables, values[: len(variables)]
        return variables, values

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
        """Stage 6: the inner optimizer updates the variables.

        `grads_and_vars` ends with the pairs of variables that overwrite
        themselves with their gradient (`overwrite_with_gradient`, Keras's
        float8 scales and amax histories), untransformed; an override must
        pass them on to the inner optimizer as they are.
        """
        model_variables = None
        if self._master_weights:
            model_variables = [v for _, v in grads_and_vars]
            grads_and_vars = self._to_master_weights(grads_and_vars)
        inner = self._inner_optimizer
        if _is_wrapper(inner):
            inner.apply_gradients(
                grads_and_vars, skip_gradients_aggregation=True
            )
        else:
            grads = [g for g, _ in grads_and_vars]
            variables = [v for _, v in grads_and_vars]
            backend_gradients.apply_aggregated(inner, grads, variables)
        if model_variables is not None:
            self._write_back_master_weights(model_variables)

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
        grads_and_vars, overwritten = split_overwritten(grads_and_vars)
        if not skip_gradients_aggregation:
            grads_and_vars = self.transform_unaggregated_gradients(
                grads_and_vars
            )
            grads_and_vars = self.aggregate_gradients(grads_and_vars)
            # A new amax history or scale per replica: the largest covers
            # every replica's batch (their sum would overstate it).
            overwritten = list(
                zip(
                    backend_gradients.all_reduce_max(
                        [g for g, _ in overwritten]
                    ),
                    [v for _, v in overwritten],
                )
            )
        self.run_step(grads_and_vars + overwritten)
        return self.iterations

    def run_step(self, grads_and_vars):
        """Stages 5-6 on aggregated gradients.

        Subclasses that may skip a step (as `LossScaleOptimizer` does on
        overflow) override this and call `apply_if(condition, ...)`.
        """
        self._transform_and_apply(grads_and_vars)

    def _transform_and_apply(self, grads_and_vars):
        grads_and_vars, overwritten = split_overwritten(grads_and_vars)
        # The overwriting pairs skip stage 5 and reach the innermost Keras
        # optimizer as they are, which assigns them (keeping the max over
        # an accumulation window); inside `apply_if`, so a skipped step
        # leaves them too.
        self.apply_updates(
            self.transform_gradients(grads_and_vars) + overwritten
        )

    def apply_if(self, condition, grads_and_vars):
        """Runs stages 5-6 only where the scalar bool `condition` holds.

        On a skipped step every model and optimizer variable keeps its exact
        value, and the condition never becomes a Python bool (no host sync).
        Inside TensorFlow graphs the update runs in a `tf.cond` branch. On
        PyTorch the update runs in place and each variable is then selected
        between its new and its saved value on the device. On JAX the
        update runs in a stateless scope inside `ops.cond` (`lax.cond`).
        In a PyTorch stateless scope it runs on copies and each variable is
        assigned `where(condition, new, old)`. This also works in
        `stateless_apply`.
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
            backups = self.__dict__.get("_skip_backups")
            if backups is None:
                backups = backend_gradients.SkipBackups()
                self.__dict__["_skip_backups"] = backups
            backend_gradients.update_in_place_unless_skipped(
                condition,
                self._transform_and_apply,
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
            # 1.22x a plain step, against 1.06x with the cond).
            def applied():
                with keras.StatelessScope(
                    state_mapping=list(zip(targets, current))
                ) as scope:
                    self._transform_and_apply(grads_and_vars)
                return [scope.get_current_value(t) for t in targets]

            values = ops.cond(condition, applied, lambda: current)
            for target, value in zip(targets, values):
                target.assign(value)
            return
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
            "state_dtype": self._state_dtype,
            "stochastic_rounding": self._stochastic_rounding,
            "master_weights": self._master_weights,
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


def _check_state_arguments(state_dtype, stochastic_rounding, master_weights):
    """Validated `state_dtype` and `stochastic_rounding` (None resolved)."""
    if state_dtype is not None:
        try:
            standardized = keras.backend.standardize_dtype(state_dtype)
        except ValueError:
            standardized = None
        if standardized not in _STATE_DTYPES:
            raise ValueError(
                "`state_dtype` must be one of "
                f"{', '.join(repr(d) for d in _STATE_DTYPES)} or None. "
                f"Received: state_dtype={state_dtype!r}. Use "
                "state_dtype='bfloat16' to halve float32 optimizer state."
            )
        state_dtype = standardized
    if stochastic_rounding is None:
        stochastic_rounding = state_dtype == "bfloat16"
    elif not isinstance(stochastic_rounding, bool):
        raise TypeError(
            "`stochastic_rounding` must be a bool or None. Received: "
            f"stochastic_rounding={stochastic_rounding!r}"
        )
    elif stochastic_rounding and state_dtype != "bfloat16":
        raise ValueError(
            "Stochastic rounding applies to bfloat16 optimizer state only "
            "(float32 state is not rounded; float16 state rounds to nearest). "
            f"Received: state_dtype={state_dtype!r}, stochastic_rounding=True. "
            "Use state_dtype='bfloat16', or leave stochastic_rounding unset."
        )
    if not isinstance(master_weights, bool):
        raise TypeError(
            "`master_weights` must be a bool. Received: "
            f"master_weights={master_weights!r}"
        )
    return state_dtype, stochastic_rounding


def stochastic_round_to_bfloat16(value, seed):
    """`value` rounded to bfloat16 up or down at random, without bias.

    A float32 is rounded up (away from zero) with probability equal to its
    distance from the bfloat16 below, measured in bfloat16 steps: 16 random
    bits are added to the low half of its bit pattern, which is then cut
    off. The expected result is `value` itself, so increments far below one
    bfloat16 step (an EMA's `(1 - beta) * (g - m)`) still move the state on
    average; rounding to nearest drops them every time. NaN stays NaN,
    infinities stay infinite.

    The bits come from a counter-based hash of each element's index and a
    key drawn from `seed`: a few integer operations per element, against
    the many of `keras.random`'s generators (Threefry, Philox), and no host
    round trip on any backend.

    Args:
        value: A float32 tensor.
        seed: A `keras.random.SeedGenerator`.

    Returns:
        A bfloat16 tensor of the same shape.
    """
    seed = ops.cast(seed.next(), "int32")
    # About twenty elementwise integer operations: one fused loop under
    # XLA, but on TensorFlow without XLA (Keras's default there) each would
    # be a pass over the whole slot, so they are compiled as one kernel.
    round_stochastically = optimizer_state.compiled_elementwise(
        _round_stochastically
    )
    return round_stochastically(ops.cast(value, "float32"), seed)


def _round_stochastically(value, seed):
    """`stochastic_round_to_bfloat16` of a float32 `value` with the int32
    key pair `seed` (a `SeedGenerator`'s draw)."""
    bits = ops.view(value, "int32")
    noise = ops.bitwise_and(_random_bits(ops.shape(value), seed), 0xFFFF)
    # -65536 is 0xFFFF0000: the sign, exponent and bfloat16 mantissa bits.
    # A carry out of the low half moves to the next bfloat16 value.
    truncated = ops.view(ops.bitwise_and(bits + noise, -65536), "float32")
    rounded = ops.where(ops.isnan(value), value, truncated)
    return ops.cast(rounded, "bfloat16")


def _saved_state_precision(values):
    """Whether trailing checkpoint values look like a seed state and masters:
    a seed state (two integers) and/or float32 arrays."""
    values = [np.asarray(v) for v in values]
    return bool(values) and all(
        (np.issubdtype(v.dtype, np.integer) and v.shape == (2,))
        or v.dtype == np.float32
        for v in values
    )


def _random_bits(shape, seed):
    """32 pseudo-random bits per element (int32), from the int32 key pair
    `seed` and each element's index through the `lowbias32` integer hash (C.
    Wellons): uniform enough for rounding noise, and cheap. int32 products
    wrap on every backend; right shifts are made logical by masking."""
    key = _hash32(ops.add(ops.multiply(seed[0], -1640531527), seed[1]))
    size = int(np.prod(shape)) if len(shape) else 1
    index = ops.reshape(ops.arange(size, dtype="int32"), shape)
    return _hash32(ops.add(index, key))


def _hash32(x):
    x = ops.bitwise_xor(x, _shift_right(x, 16))
    x = ops.multiply(x, 0x7FEB352D)
    x = ops.bitwise_xor(x, _shift_right(x, 15))
    x = ops.multiply(x, -2073254261)  # 0x846CA68B as an int32
    return ops.bitwise_xor(x, _shift_right(x, 16))


def _shift_right(x, bits):
    """Logical right shift of int32 values."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)


def _check_state_precision_target(optimizer, state_dtype, master_weights, name):
    """Refuses state precision settings the wrapped optimizer cannot take."""
    if state_dtype is None and not master_weights:
        return
    owner = _state_precision_owner(optimizer)
    if owner is not None:
        raise ValueError(
            "`state_dtype` and `master_weights` belong to one wrapper of a "
            f"chain, and the inner wrapper {owner.name!r} already sets them. "
            f"Received: state_dtype={state_dtype!r}, master_weights="
            f"{master_weights!r} on {name or 'the outer wrapper'!r}. Set "
            "them on one wrapper only."
        )
    base = optimizer
    while _is_wrapper(base):
        base = base.inner_optimizer
    if base.built:
        raise ValueError(
            "`state_dtype` and `master_weights` decide how the inner "
            "optimizer creates its variables, so it must not be built yet. "
            f"Received: the built optimizer {base.name!r}. Wrap a fresh "
            "optimizer."
        )


def _state_precision_owner(optimizer):
    """The wrapper in `optimizer`'s chain that sets state precision, or None."""
    while _is_wrapper(optimizer):
        if optimizer._state_dtype is not None or optimizer._master_weights:
            return optimizer
        optimizer = optimizer.inner_optimizer
    return None


def _hyperparameter_names(optimizer):
    """The attribute names a wrapper delegates to `optimizer`."""
    names = set(optimizer.get_config()) - {"name"}
    if _is_wrapper(optimizer):
        # A wrapper's own config keys (the nested optimizer, its transforms)
        # are structure, not hyperparameters; what it delegates passes on.
        names -= {"optimizer", "inner_optimizer", "transform_gradients"}
        names -= {"aggregate_gradients"}
        names -= {"state_dtype", "stochastic_rounding", "master_weights"}
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
