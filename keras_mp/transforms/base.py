"""Transform, Chain and the registry of named gradient transforms.

A transform maps a list of `(gradient, variable)` pairs to a new list of the
same length and order, as optax's `GradientTransformation` maps gradient
trees. Unlike optax's closures, a transform is an object with a config and
state in Keras variables, so it serializes by name and travels through
compiled steps (tf.function, XLA, `jax.jit` under `keras.StatelessScope`).
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


@keras.saving.register_keras_serializable(package="keras_mp")
class CallableTransform(Transform):
    """Runs a plain callable as a transform (RFC 234's examples).

    The callable takes and returns a list of `(gradient, variable)` pairs.
    It works in every step, but cannot be serialized: to save an optimizer
    that uses it, subclass `Transform` and register it with
    `register_transform`.

    Args:
        fn: Callable taking and returning `(gradient, variable)` pairs.
        name: Defaults to `"callable_transform"`.

    Example:

    >>> halve = keras_mp.transforms.CallableTransform(
    ...     lambda pairs: [(g / 2, v) for g, v in pairs]
    ... )
    >>> v = keras.Variable([0.0])
    >>> [(g, _)] = halve([(keras.ops.array([3.0]), v)])
    >>> keras.ops.convert_to_numpy(g).tolist()
    [1.5]
    """

    def __init__(self, fn, name=None):
        if not callable(fn):
            raise TypeError(
                "`fn` must be a callable taking and returning (gradient, "
                f"variable) pairs. Received: fn={fn!r}"
            )
        super().__init__(name=name)
        self.fn = fn

    def call(self, grads_and_vars):
        return self.fn(grads_and_vars)

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        raise TypeError(
            f"Transform {self.name!r} wraps the plain callable {self.fn!r}, "
            "which cannot be serialized. To save it, subclass "
            "keras_mp.transforms.Transform, implement `call(grads_and_vars)` "
            "and `get_config()`, and register the class with "
            "@keras_mp.transforms.register_transform('my_transform')."
        )

    def __repr__(self):
        return f"CallableTransform({self.fn!r}, name={self.name!r})"


@register_transform("chain")
class Chain(Transform):
    """Applies transforms in order, each to the output of the previous one.

    Args:
        transforms: List of transforms, each given as a `Transform`, a
            registered name (`"clip_by_global_norm"`), a `(name, config)`
            tuple, a serialized config dict, or a plain callable taking and
            returning `(gradient, variable)` pairs. Defaults to `()`.
        name: Defaults to `"chain"`.

    Example:

    >>> chain = keras_mp.transforms.Chain(
    ...     [("clip_by_value", {"clip_value": 1.0}), "replace_non_finite"]
    ... )
    >>> v = keras.Variable([0.0, 0.0, 0.0])
    >>> [(g, _)] = chain([(keras.ops.array([-3.0, 0.5, np.nan]), v)])
    >>> keras.ops.convert_to_numpy(g).tolist()
    [-1.0, 0.5, 0.0]
    """

    def __init__(self, transforms=(), name=None):
        super().__init__(name=name)
        if _is_single_spec(transforms):
            transforms = [transforms]
        if not isinstance(transforms, (list, tuple)):
            raise TypeError(
                "`transforms` must be a list of transforms. Received: "
                f"transforms={transforms!r}"
            )
        self._transforms = [get(t) for t in transforms]

    @property
    def transforms(self):
        """The member transforms, in order."""
        return list(self._transforms)

    @Transform.optimizer.setter
    def optimizer(self, optimizer):
        self._optimizer = optimizer
        for transform in self._transforms:
            transform.optimizer = optimizer

    def build(self, var_list):
        for transform in self._transforms:
            if transform.optimizer is None:
                transform.optimizer = self.optimizer
            transform.build(var_list)
        self._named_state()

    @property
    def variables(self):
        variables, seen = [], set()
        for transform in self._transforms:
            for variable in transform.variables:
                if id(variable) not in seen:
                    seen.add(id(variable))
                    variables.append(variable)
        return variables

    def call(self, grads_and_vars):
        for transform in self._transforms:
            grads_and_vars = transform(grads_and_vars)
        return grads_and_vars

    def get_config(self):
        """Every constructor argument, as `from_config` takes it."""
        config = super().get_config()
        config["transforms"] = [serialize(t) for t in self._transforms]
        return config

    def __repr__(self):
        return f"Chain({self._transforms!r}, name={self.name!r})"

    def _named_state(self):
        named = {}
        for transform in self._transforms:
            for key, variable in transform._named_state().items():
                if key in named and named[key] is not variable:
                    raise ValueError(
                        f"Two transforms of chain {self.name!r} hold state "
                        f"under the same key {key!r}. Received two "
                        f"transforms named {key.split('/')[0]!r}; pass a "
                        "distinct `name=` to one of them."
                    )
                named[key] = variable
        return named


def _is_single_spec(value):
    if isinstance(value, (str, dict, Transform)):
        return True
    if callable(value):
        return True
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], dict)
    )


def serialize(transform):
    """The Keras serialized config of a transform (a dict)."""
    return keras.saving.serialize_keras_object(transform)


def deserialize(config, custom_objects=None):
    """The transform of a config from `serialize`."""
    transform = keras.saving.deserialize_keras_object(
        config, custom_objects=custom_objects
    )
    if not isinstance(transform, Transform):
        raise TypeError(
            "The config does not describe a keras_mp transform. Received: "
            f"config={config!r}, which gave {transform!r}"
        )
    return transform


def get(identifier):
    """Resolves a transform from any of the accepted specifications.

    Args:
        identifier: A `Transform` (returned as is), a registered name
            (`"clip_by_value"`, or a Keras registered name like
            `"keras_mp>ClipByValue"`), a `(name, config)` tuple, a serialized
            config dict (`serialize`'s output), or a plain callable taking and
            returning `(gradient, variable)` pairs (wrapped in a
            `CallableTransform`).

    Returns:
        A `Transform`.

    Raises:
        ValueError: for an unknown name; the message lists the registered
            ones.
        TypeError: for any other kind of value.

    Example:

    >>> keras_mp.transforms.get("clip_by_global_norm").max_norm
    1.0
    >>> clip = keras_mp.transforms.get(("clip_by_value", {"clip_value": 0.5}))
    >>> clip.clip_value
    0.5
    """
    if isinstance(identifier, Transform):
        return identifier
    if isinstance(identifier, str):
        cls = _class_of(identifier)
        try:
            return cls()
        except TypeError as error:
            raise TypeError(
                f"Transform {identifier!r} has required arguments ({error}). "
                f"Received: {identifier!r}. Pass a (name, config) tuple such "
                f"as ({identifier!r}, {{...}}) instead."
            ) from error
    if (
        isinstance(identifier, tuple)
        and len(identifier) == 2
        and isinstance(identifier[0], str)
        and isinstance(identifier[1], dict)
    ):
        return _class_of(identifier[0]).from_config(dict(identifier[1]))
    if isinstance(identifier, dict):
        class_name = identifier.get("class_name")
        if class_name in _TRANSFORMS:
            return _TRANSFORMS[class_name].from_config(
                dict(identifier.get("config") or {})
            )
        if class_name is None:
            raise ValueError(
                "A transform config dict must be a Keras serialized config "
                "(with 'class_name' and 'config'), as "
                "keras_mp.transforms.serialize returns. Received: "
                f"{identifier!r}. For a name and its arguments, pass a "
                "(name, config) tuple instead."
            )
        return deserialize(identifier)
    if isinstance(identifier, type) and issubclass(identifier, Transform):
        return identifier()
    if callable(identifier):
        return CallableTransform(identifier)
    raise TypeError(
        "A transform must be a keras_mp.transforms.Transform, a registered "
        "name, a (name, config) tuple, a serialized config dict or a callable "
        "taking and returning (gradient, variable) pairs. Received: "
        f"{identifier!r} (of type {type(identifier).__name__})"
    )


def _class_of(name):
    if name in _TRANSFORMS:
        return _TRANSFORMS[name]
    registered = keras.saving.get_registered_object(name)
    if isinstance(registered, type) and issubclass(registered, Transform):
        return registered
    raise ValueError(
        f"Unknown transform name: {name!r}. Registered transforms: "
        f"{sorted(_TRANSFORMS)}. Register new ones with "
        "@keras_mp.transforms.register_transform(name)."
    )


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
