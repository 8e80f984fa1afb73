"""Composing transforms: `Chain`, plain callables, and specs to transforms.

`get` turns an instance, a registered name, a `(name, config)` pair or a
plain callable (`CallableTransform`) into a transform; `Chain` runs them in
order; `serialize`/`deserialize` go through Keras's registry.
"""

import keras

from keras_mp.transforms.base import _TRANSFORMS
from keras_mp.transforms.base import Transform
from keras_mp.transforms.base import register_transform


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
