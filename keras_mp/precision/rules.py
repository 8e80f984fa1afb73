"""The rules API: `precision_rules`, `PrecisionRules` (and its
`policy_map`), `DEFAULT_FLOAT32_ISLANDS`, and what a rule reads of a model:
its layers, their paths, its output layers, a rule's policy fitted to a
layer that has weights."""

from __future__ import annotations

import re
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import keras

from keras_mp import _keras_internals
from keras_mp import policy as policy_module
from keras_mp.policy import Policy

# `outputs=` was not given, as opposed to `outputs=None` (output layers keep
# the global policy, overriding a base rule set).
_UNSET = object()


class _Rule:
    """One selector and the policy it gives; None keeps the global policy."""

    def __init__(self, selector, policy, origin):
        self.selector = selector
        self.policy = policy
        self.origin = origin

    def matches(self, layer, path, is_output):
        if self.selector is _OUTPUTS:
            return is_output
        if isinstance(self.selector, str):
            return path is not None and re.fullmatch(self.selector, path)
        return isinstance(layer, self.selector)

    def __str__(self):
        if self.selector is _OUTPUTS:
            selector = "model outputs"
        elif isinstance(self.selector, str):
            selector = f"path {self.selector!r}"
        else:
            selector = " | ".join(c.__name__ for c in self.selector)
        target = "global policy" if self.policy is None else self.policy.name
        return f"{self.origin}: {selector} -> {target}"


_OUTPUTS = object()


class PrecisionRules:
    """An ordered set of rules from layers to dtype policies.

    Made by `keras_mp.precision_rules`; see there. The first rule that
    matches a layer gives its policy.
    """

    def __init__(self, rules: Iterable[_Rule], name: str) -> None:
        self._rules = tuple(rules)
        self._name = name

    @property
    def name(self) -> str:
        """The name that `explain_precision` shows beside each rule."""
        return self._name

    @property
    def rules(self) -> list[str]:
        """The rules, in the order they are tried, as readable strings."""
        return [str(rule) for rule in self._rules]

    def _match(self, layer, path, is_output, class_rules_only=False):
        for rule in self._rules:
            if class_rules_only and not isinstance(rule.selector, tuple):
                continue
            if rule.matches(layer, path, is_output):
                return rule
        return None

    def policy_map(
        self, model: keras.Model
    ) -> keras.dtype_policies.DTypePolicyMap:
        """Compiles the rules for a built model into a `DTypePolicyMap`.

        Args:
            model: A built Keras model.

        Returns:
            A `keras.dtype_policies.DTypePolicyMap` whose default is the
            model's policy, with one exact-path entry (a layer's `path`, or
            its `name` for a layer without weights, which Keras gives no
            path) for each layer of the model that a rule gives a policy.
            Layers built from config with this map as `dtype` look their
            entry up by path.
        """
        check_model(model)
        policy_map = keras.dtype_policies.DTypePolicyMap(
            default_policy=policy_module.layer_policy(model)
        )
        outputs = output_layers(model)
        for layer in walk_layers(model, into_models=True):
            rule = self._match(layer, layer_path(layer), id(layer) in outputs)
            if rule is not None and rule.policy is not None:
                policy_map[layer_path(layer)] = fitted_policy(
                    rule.policy, layer
                )
        return policy_map

    def __repr__(self):
        rules = "; ".join(self.rules)
        return f"<PrecisionRules {self._name!r}: {rules}>"


def _to_rule_policy(value, key):
    if value is None:
        return None
    try:
        return policy_module._to_policy(value)
    except (TypeError, ValueError) as error:
        raise ValueError(
            "A precision rule maps to a policy (a name such as 'float32', "
            "a spec, a keras_mp.Policy or a keras.DTypePolicy) or to None "
            f"(keep the global policy). Received: {key!r} -> {value!r} "
            f"({error})"
        ) from None


def _to_selector(key):
    if isinstance(key, str):
        try:
            re.compile(key)
        except re.error as error:
            raise ValueError(
                "A path pattern must be a regular expression matched against "
                f"the whole layer path. Received: {key!r} ({error})"
            ) from None
        return key
    classes = key if isinstance(key, tuple) else (key,)
    if not classes or not all(
        isinstance(c, type) and issubclass(c, keras.layers.Layer)
        for c in classes
    ):
        raise TypeError(
            "A precision rule's key is a Keras layer class (or a tuple of "
            "them) or a layer path pattern (a string, matched with "
            f"re.fullmatch against `layer.path`). Received: {key!r}"
        )
    return classes


def precision_rules(
    rules: Mapping[Any, Any] | None = None,
    outputs: Any = _UNSET,
    base: PrecisionRules | str | None = None,
    name: str | None = None,
) -> PrecisionRules:
    """Declares which layers get which dtype policy, such as float32 islands.

    Active rules (`keras_mp.set_global_policy(policy, float32_islands=rules)`)
    apply to every layer created afterwards without a deliberate `dtype`: a
    layer created with `dtype=` keeps it, unless that argument is the
    global policy in force handed on (the very object, or a policy object
    equal to it), as `MultiHeadAttention` and keras-hub's layers hand their
    own policy to the layers they create; such layers follow the rules
    (see `_in_force`). Inside a layer (not a model), an island returns the
    compute dtype of the layer that holds it, and the layers inside a block
    a rule gives another compute dtype follow it. The first matching rule
    wins: the entries of `rules` in order, then `outputs`, then the rules
    of `base`, so user rules override the defaults they extend.

    When they apply: class rules when the layer is created (so its weights
    are created in the right dtype); path and `outputs` rules once the model
    is known, when a Sequential or functional model is built, or after the
    first call of a subclassed model (which `fit` makes before it traces
    its training step). Each layer is decided once, by the first model
    built on it: a second model over the same layers (a feature extractor)
    changes nothing, and a layer `add`ed to an already built Sequential
    model does not move the output rule to it. A layer that already has
    weights keeps their dtype and takes the rule's compute and output
    dtypes. Subclassed models have no
    layer graph, so `outputs` cannot find their output layers: name those
    with a path or class rule. The resulting dtypes are saved with the
    model, so it reloads with them, rules active or not: in each layer's
    config, and for a model that rebuilds its layers from its constructor
    arguments (keras-hub's tasks and backbones) in a record beside its
    config (see `_record`).

    Under a global `keras.dtype_policies.DTypePolicyMap`, layers that no
    rule matches follow the map; a rule that matches a layer wins over the
    map's entry for that layer's path, and a warning says so when their
    dtypes differ (a rule giving None keeps the entry).

    Args:
        rules: A dict from a Keras layer class (or a tuple of classes) or a
            layer path pattern (a regular expression matched with
            `re.fullmatch` against `layer.path`, or against `layer.name`
            for layers that have no weights and so no path) to a policy:
            anything `keras_mp.Policy` takes, or None to keep the global
            policy (which switches a `base` rule off). Defaults to None.
        outputs: The policy of the layers that produce a Sequential or
            functional model's outputs (the logits, the probabilities), or
            None to keep the global policy there. Defaults to not set.
        base: Rules these extend: `"default"` (`DEFAULT_FLOAT32_ISLANDS`),
            a `PrecisionRules`, or None. Defaults to None.
        name: Shown by `explain_precision` beside each rule. Defaults to
            `"precision_rules"`.

    Returns:
        A `PrecisionRules`.

    Example:

    >>> rules = keras_mp.precision_rules(
    ...     {"head_.*": "float32", keras.layers.Softmax: None}, base="default"
    ... )
    >>> for rule in rules.rules:
    ...     print(rule)
    precision_rules: path 'head_.*' -> float32
    precision_rules: Softmax -> global policy
    DEFAULT_FLOAT32_ISLANDS: Softmax -> float32
    DEFAULT_FLOAT32_ISLANDS: model outputs -> float32
    """
    name = "precision_rules" if name is None else name
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a string. Received: name={name!r}")
    if rules is None:
        rules = {}
    if not isinstance(rules, dict):
        raise TypeError(
            "`rules` must be a dict from layer classes or path patterns to "
            f"policies. Received: rules={rules!r}"
        )
    compiled = [
        _Rule(_to_selector(key), _to_rule_policy(value, key), name)
        for key, value in rules.items()
    ]
    if outputs is not _UNSET:
        compiled.append(
            _Rule(_OUTPUTS, _to_rule_policy(outputs, "outputs"), name)
        )
    base = resolve_rules(base, "base")
    if base is not None:
        compiled.extend(base._rules)
    return PrecisionRules(compiled, name)


def resolve_rules(value, argument):
    if value is None or isinstance(value, PrecisionRules):
        return value
    if isinstance(value, str) and value == "default":
        return DEFAULT_FLOAT32_ISLANDS
    raise ValueError(
        f"`{argument}` must be 'default', a keras_mp.precision_rules(...) "
        f"or None. Received: {argument}={value!r}"
    )


DEFAULT_FLOAT32_ISLANDS = precision_rules(
    {keras.layers.Softmax: "float32"},
    outputs="float32",
    name="DEFAULT_FLOAT32_ISLANDS",
)
"""The float32 islands of `set_global_policy(..., float32_islands="default")`.

`Softmax` layers, and the layers that produce a Sequential or functional
model's outputs (logits, or a final softmax/sigmoid activation), compute in
float32. Normalization statistics and losses need no rule: Keras computes
them in float32 already (see `keras_mp.precision`'s docstring).
"""


def layer_path(layer):
    # Keras sets `path` when a layer builds; layers without weights never
    # build and have none, so their name stands in.
    return layer.path if layer.path is not None else layer.name


def walk_layers(layer, into_models, seen=None):
    """The layers inside `layer`, depth first, each once (a layer two
    parents hold, as keras-hub's task and backbone share an embedding,
    where it is first reached); into nested models only if `into_models`."""
    seen = {id(layer)} if seen is None else seen
    for sublayer in layer._flatten_layers(include_self=False, recursive=False):
        if id(sublayer) in seen:
            continue
        seen.add(id(sublayer))
        yield sublayer
        if into_models or not isinstance(sublayer, keras.Model):
            yield from walk_layers(sublayer, into_models, seen)


def output_layers(model):
    """ids of the layers producing a functional model's outputs."""
    outputs = getattr(model, "_functional", model)
    if not isinstance(outputs, _keras_internals.Functional):
        return set()
    layers = set()
    for tensor in keras.tree.flatten(outputs.outputs):
        operation = _keras_internals.producing_operation(tensor)
        if isinstance(operation, keras.layers.Layer) and not isinstance(
            operation, (keras.layers.InputLayer, keras.Model)
        ):
            layers.add(id(operation))
    return layers


def fitted_policy(policy, layer):
    """`policy`, keeping the variable dtype of a layer that has weights."""
    current = policy_module.layer_policy(layer)
    if (
        not layer.weights
        or isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        or policy.variable_dtype == current.variable_dtype
    ):
        return policy
    return Policy(
        f"params={current.variable_dtype},compute={policy.compute_dtype},"
        f"output={policy.output_dtype}",
        loss_scale=policy.loss_scale,
        fp8=policy.fp8,
    )


def check_model(model):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "Expected a Keras model or layer. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )
