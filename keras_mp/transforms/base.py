"""Transform and the registry of named gradient transforms.

A transform maps a list of `(gradient, variable)` pairs to a new list of the
same length and order, as optax's `GradientTransformation` maps gradient
trees. Unlike optax's closures, a transform is an object with a config and
state in Keras variables, so it serializes by name and travels through
compiled steps (tf.function, XLA, `jax.jit` under `keras.StatelessScope`).
`Chain`, `get` and (de)serialization are in `chain.py`.
"""

import functools
import math
import numbers
import re

import keras
import numpy as np

from keras_mp import _config
from keras_mp import _keras_internals

# Short snake_case name -> Transform subclass.
_TRANSFORMS = {}

_VALID_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-]*")


def register_transform(name, package="keras_mp"):
    """Registers a `Transform` subclass under a short name.

    The class becomes available to `get` (and so to
    `OptimizerWrapper(transform_gradients=[...])`) as `name`, and is
    registered with `keras.saving.register_keras_serializable` as
    `"package>ClassName"`, so optimizers using it save and load.

    Args:
        name: Short snake_case name, e.g. `"clip_by_value"`.
        package: Package part of the Keras registered name. Defaults to
            `"keras_mp"`.

    Returns:
        A class decorator that returns the class unchanged.

    Example:

    >>> @keras_mp.transforms.register_transform("negate_doc_example")
    ... class Negate(keras_mp.transforms.Transform):
    ...     def call(self, grads_and_vars):
    ...         return [(-g, v) for g, v in grads_and_vars]
    >>> type(keras_mp.transforms.get("negate_doc_example")).__name__
    'Negate'
    >>> keras.saving.get_registered_name(Negate)
    'keras_mp>Negate'
    """
    if not isinstance(name, str) or not _VALID_NAME.fullmatch(name):
        raise ValueError(
            "A transform's registered name must be a non-empty string of "
            f"letters, digits, '_', '.' or '-'. Received: name={name!r}"
        )

    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, Transform)):
            raise TypeError(
                "`register_transform` decorates subclasses of "
                f"keras_mp.transforms.Transform. Received: {cls!r}"
            )
        previous = _TRANSFORMS.get(name)
        # Re-running a class definition (a notebook cell, a reload) is fine;
        # taking a name another class holds would silently change what
        # saved configs load as.
        if previous is not None and _qualified_name(previous) != (
            _qualified_name(cls)
        ):
            raise ValueError(
                f"The transform name {name!r} is already registered to "
                f"{_qualified_name(previous)}. Received: "
                f"{_qualified_name(cls)}. Register it under another name."
            )
        _TRANSFORMS[name] = cls
        cls._registered_transform_name = name
        return keras.saving.register_keras_serializable(package=package)(cls)

    return decorator


def _qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _default_name(cls):
    registered = cls.__dict__.get("_registered_transform_name")
    if registered is not None:
        return registered
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", cls.__name__)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    return name.lstrip("_") or "transform"


def _guarded_build(build):
    """Makes a subclass's `build` run once, under the transform's name scope."""

    @functools.wraps(build)
    def wrapper(self, var_list):
        if self.built:
            return
        if getattr(self, "_building", False):
            # A subclass's `build` calling `super().build(...)`.
            build(self, var_list)
            return
        created = len(self._variables)
        counts = dict(self._reference_counts)
        self._building = True
        try:
            with keras.name_scope(self.name):
                build(self, list(var_list))
        except BaseException:
            # A failed build leaves no half-made state behind, so a retry
            # does not create the variables twice.
            del self._variables[created:]
            self._reference_counts = counts
            raise
        finally:
            self._building = False
        self.built = True

    return wrapper


class Transform:
    """Base class of gradient transforms.

    A transform takes a list of `(gradient, variable)` pairs and returns a
    new list of the same length and order. Subclasses implement `call`, and
    `build` when they keep state, which lives in Keras variables made with
    `add_variable` (so JAX stateless steps and checkpoints carry it).
    `__call__` builds the transform from the variables it receives when it
    is not built yet.

    Rules that let a transform run inside a compiled step: all math through
    `keras.ops`, no Python branching on tensor values, state changed only
    with `variable.assign(...)`, and `None` gradients passed through as is.

    An optimizer running the transform (`keras_mp.OptimizerWrapper`) sets
    `transform.optimizer` to itself before building it, so a transform can
    read e.g. the learning rate.

    Args:
        name: Name of the transform, used as its variables' name scope and in
            the keys of `get_state()`. Defaults to the registered name of the
            class (e.g. `"clip_by_value"`).

    Example:

    >>> class Double(keras_mp.transforms.Transform):
    ...     def call(self, grads_and_vars):
    ...         return [(2 * g, v) for g, v in grads_and_vars]
    >>> v = keras.Variable([1.0])
    >>> [(g, _)] = Double()([(keras.ops.array([1.5]), v)])
    >>> keras.ops.convert_to_numpy(g).tolist()
    [3.0]
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "build" in cls.__dict__:
            cls.build = _guarded_build(cls.__dict__["build"])

    def __init__(self, name=None):
        if name is None:
            name = _default_name(type(self))
        if not isinstance(name, str) or not _VALID_NAME.fullmatch(name):
            raise ValueError(
                "A transform's `name` must be a non-empty string of letters, "
                f"digits, '_', '.' or '-' (no '/'). Received: name={name!r}"
            )
        self.name = name
        self.built = False
        self._optimizer = None
        self._variables = []
        self._reference_counts = {}

    @property
    def optimizer(self):
        """The optimizer running this transform, or None."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer):
        self._optimizer = optimizer

    def build(self, var_list):
        """Creates the state variables for the model variables `var_list`.

        Called once, by an optimizer's `build` or by the first `__call__`;
        later calls do nothing. Override to create state with
        `add_variable` / `add_variable_from_reference`.
        """
        if self.built:
            return
        self.built = True

    @property
    def variables(self):
        """The state variables, in a fixed order."""
        return list(self._variables)

    def add_variable(
        self,
        shape,
        initializer="zeros",
        dtype="float32",
        name=None,
        aggregation="only_first_replica",
        layout=None,
    ):
        """Creates a non-trainable state variable of this transform.

        Call it from `build`. The default aggregation suits state that every
        replica updates identically from aggregated gradients.

        Args:
            shape: Shape of the variable.
            initializer: Initializer name, instance or callable. Defaults to
                `"zeros"`.
            dtype: Dtype of the variable. Defaults to `"float32"`.
            name: Name, unique within the transform. Defaults to
                `"variable_<index>"`.
            aggregation: Keras variable aggregation. Defaults to
                `"only_first_replica"`.
            layout: Its layout under `keras.distribution` (a
                `keras.distribution.TensorLayout` or a backend layout).
                Defaults to `None` (the distribution's default).

        Returns:
            The Keras variable.
        """
        if name is None:
            name = f"variable_{len(self._variables)}"
        if isinstance(initializer, str):
            initializer = keras.initializers.get(initializer)
        variable = keras.Variable(
            initializer,
            shape=shape,
            dtype=dtype,
            trainable=False,
            autocast=False,
            aggregation=aggregation,
            name=name,
            layout=layout,
        )
        return self._track_variable(variable)

    def add_variable_from_reference(
        self, reference_variable, name, initializer="zeros", dtype=None
    ):
        """Creates a state variable shaped like a model variable.

        For per-variable state such as moments, laid out as the model
        variable under `keras.distribution` (a sharded kernel's state is
        sharded alike). The variable is named `"<name>_<i>"`, `i` counting
        the variables made here with that name:
        by position, not by the model variable's path, which Keras changes
        when a model is reloaded, so `get_state()` of a model sets the state
        of its reloaded copy.

        Args:
            reference_variable: The model variable.
            name: Suffix of the name, e.g. `"momentum"`.
            initializer: Defaults to `"zeros"`.
            dtype: Defaults to the model variable's stored dtype.

        Returns:
            The Keras variable.
        """
        if dtype is None:
            dtype = _keras_internals.stored_dtype(reference_variable)
        count = self._reference_counts.get(name, 0)
        self._reference_counts[name] = count + 1
        return self.add_variable(
            shape=reference_variable.shape,
            initializer=initializer,
            dtype=dtype,
            name=f"{name}_{count}",
            layout=_keras_internals.variable_layout(reference_variable),
        )

    def _track_variable(self, variable):
        """Adds an existing variable (e.g. a SeedGenerator's) to the state."""
        for existing in self._variables:
            if existing.name == variable.name:
                raise ValueError(
                    f"Transform {self.name!r} already has a variable named "
                    f"{variable.name!r}. Received a second one. Give each "
                    "state variable a distinct name."
                )
        self._variables.append(variable)
        return variable

    def call(self, grads_and_vars):
        """Returns transformed `(gradient, variable)` pairs.

        Args:
            grads_and_vars: List of `(gradient, variable)` pairs; a gradient
                may be None.

        Returns:
            A list of pairs of the same length and order, with the same
            variables and None gradients left None.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement `call(grads_and_vars)`."
        )

    def __call__(self, grads_and_vars):
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        if not self.built:
            self.build([v for _, v in grads_and_vars])
        result = [(g, v) for g, v in self.call(grads_and_vars)]
        if len(result) != len(grads_and_vars) or any(
            new is not old for (_, new), (_, old) in zip(result, grads_and_vars)
        ):
            raise ValueError(
                f"Transform {self.name!r} must return one (gradient, "
                "variable) pair per input pair, with the same variables in "
                f"the same order. Received {len(grads_and_vars)} pairs and "
                f"returned {len(result)}, or reordered them."
            )
        return result

    # ---------------------------------------------------------------- config
    def get_config(self):
        """Every constructor argument, as plain Python values."""
        return {"name": self.name}

    @classmethod
    def from_config(cls, config):
        """Restores a transform from `get_config()`'s output."""
        _config.check_config(cls, config)
        return cls(**config)

    # ----------------------------------------------------------------- state
    def _named_state(self):
        """`{key: variable}` of all state, in `variables` order."""
        return {f"{self.name}/{v.name}": v for v in self._variables}

    def get_state(self):
        """All state as `{"<transform name>/<variable name>": numpy array}`."""
        return {
            key: np.array(keras.ops.convert_to_numpy(variable.value))
            for key, variable in self._named_state().items()
        }

    def set_state(self, state):
        """Restores `get_state()`'s output, all or nothing.

        Every key, shape and dtype is checked before anything is assigned,
        so on a mismatch the state stays exactly as it was.

        Raises:
            ValueError: naming the first mismatch.
        """
        if not isinstance(state, dict):
            raise TypeError(
                "`state` must be a dict as returned by `get_state()`. "
                f"Received: state of type {type(state).__name__}"
            )
        named = self._named_state()
        missing = sorted(set(named) - set(state))
        unexpected = sorted(set(state) - set(named))
        if missing or unexpected:
            hint = ""
            if not self.built:
                hint = (
                    f" Transform {self.name!r} is not built, so it has no "
                    "state yet: build it (or run one step) first."
                )
            raise ValueError(
                f"State keys of transform {self.name!r} do not match. "
                f"Missing: {missing}; unexpected: {unexpected}. Expected "
                f"keys: {sorted(named)}.{hint}"
            )
        values = {}
        for key, variable in named.items():
            value = np.asarray(state[key])
            expected_dtype = keras.backend.standardize_dtype(variable.dtype)
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"State {key!r} must have shape {tuple(variable.shape)}. "
                    f"Received: shape {tuple(value.shape)}. Nothing was "
                    "assigned."
                )
            if keras.backend.standardize_dtype(value.dtype) != expected_dtype:
                raise ValueError(
                    f"State {key!r} must have dtype {expected_dtype}. "
                    f"Received: dtype {value.dtype}. Nothing was assigned; "
                    "cast the array first."
                )
            values[key] = value
        for key, variable in named.items():
            variable.assign(values[key])

    def __repr__(self):
        arguments = ", ".join(
            f"{k}={v!r}" for k, v in self.get_config().items()
        )
        return f"{type(self).__name__}({arguments})"


keras.saving.register_keras_serializable(package="keras_mp")(Transform)


def _number(name, value):
    """`value` as a float, after checking it is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a number. Received: {name}={value!r} (of type "
            f"{type(value).__name__})"
        )
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite. Received: {name}={value!r}")
    return float(value)
