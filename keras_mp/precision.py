"""Precision rules: float32 islands in a mixed model, and the FP8 rules.

Mixed precision is a per-layer decision. A few places lose too much in 16
bits: a softmax over many classes, the logits a loss reads. tf.keras left
them to a rule users had to remember ("put `dtype='float32'` on the last
layer"). Here they are declared once, as rules from a layer class or a layer
path pattern to a policy, applied to every model built while they are active,
and `explain_precision` (in `explain.py`) answers "why is this layer
float32?". The FP8 rules of `set_global_policy(..., fp8=recipe)` are
decided here too, with `fp8_layers`, at the same three moments: a layer's
creation, its build and its model's build.

What Keras 3 already does, so no rule is needed for it:

- Normalization statistics: `BatchNormalization`, `LayerNormalization`,
  `GroupNormalization` and `RMSNormalization` upcast their inputs to float32
  to compute mean and variance, keep their gamma/beta/moving statistics in
  float32 (`autocast=False`), and cast the result back to the compute dtype.
  Giving them a float32 policy would only add casts.
- Losses: Keras losses convert predictions to their own `dtype` (float32
  unless set), and `keras_mp.losses` do the same; the loss is a float32
  island already.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
import weakref
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import keras

from keras_mp import _keras_internals
from keras_mp import autocast
from keras_mp import fp8_layers
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
them in float32 already (see the module docstring).
"""


policy_module._install_islands_resolver(
    lambda value: resolve_rules(value, "float32_islands")
)


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


def _set_policy(layer, policy):
    if isinstance(layer.dtype_policy, keras.dtype_policies.DTypePolicyMap):
        _keras_internals.replace_layer_policy(layer, policy)
    else:
        layer.dtype_policy = policy
    casts = layer.compute_dtype != layer.variable_dtype
    for variable in _keras_internals.own_variables(layer):
        if _keras_internals.variable_autocasts(variable):
            autocast.set_marked(variable, casts)


_loading = threading.local()


@contextlib.contextmanager
def _deserializing():
    """While Keras rebuilds objects from a saved config, where every
    `dtype=` is what was saved, never a policy handed on."""
    _loading.depth = getattr(_loading, "depth", 0) + 1
    try:
        yield
    finally:
        _loading.depth -= 1


def _in_force(dtype):
    """Whether a `dtype=` argument is the policy in force, not a choice.

    A layer that passes its own policy to the layers it creates (Keras's
    `MultiHeadAttention`, every keras-hub backbone and block:
    `dtype=self.dtype_policy`) hands them the global policy object when it
    was itself created without a `dtype`. Such an argument, the very policy
    object a layer created here without `dtype` would get or a policy
    object equal to it (same class and name; for a keras_mp `Policy` the
    same loss scale and FP8 recipe too), leaves the layer to the rules. A
    name string, or any other policy, is a deliberate choice, which wins;
    so is every `dtype=` of a model being loaded (its saved dtypes, and the
    record `_restore` applies, decide).
    """
    if not isinstance(dtype, keras.DTypePolicy) or getattr(
        _loading, "depth", 0
    ):
        return False
    current = keras.config.dtype_policy()
    if dtype is current:
        return True
    if isinstance(dtype, keras.dtype_policies.DTypePolicyMap):
        return False
    return type(dtype) is type(current) and dtype == current


# The layers whose policy came from their `dtype` argument, as
# `explain_precision` names them. Kept beside the layers, not in them: Keras's
# own tests (`run_class_serialization_test`) compare `dir(layer)` of a layer
# and of its copy from `from_config`, which gets `dtype` as a config.
_given_dtype = weakref.WeakSet()


def given_dtype(layer):
    """Whether `layer`'s policy came from a deliberate `dtype` argument."""
    return layer in _given_dtype


def _install_layer_init_hook():
    original = keras.layers.Layer.__init__
    if getattr(original, "_keras_mp_hook", False):
        return

    # Keyword-only, as `Layer.__init__` is: `Operation.__new__` reads the
    # signature (through `__wrapped__`) and the argspec (of this function)
    # of a layer class's `__init__` to record its auto config.
    @functools.wraps(original)
    def __init__(self, **kwargs):
        dtype = kwargs.get("dtype")
        handed_on = dtype is not None and _in_force(dtype)
        explicit = dtype is not None and not handed_on
        original(self, **kwargs)
        if explicit:
            # What `explain_precision` names: only such a layer's policy
            # came from a dtype argument.
            _given_dtype.add(self)
            fp8_layers.check_layer(self)
        rules = policy_module.global_float32_islands()
        recipe = policy_module.global_fp8()
        if explicit or (rules is None and recipe is None):
            return
        self._keras_mp_islands = rules
        self._keras_mp_global_policy = self.dtype_policy
        if recipe is not None:
            fp8_layers.consider(self, recipe)
        rule = None
        if rules is not None:
            rule = rules._match(self, None, False, class_rules_only=True)
        if rule is not None and rule.policy is not None:
            policy = rule.policy
            if handed_on:
                # Made by another layer's code, which reads its outputs
                # (`_apply_rules` settles this from the actual parent).
                compute = self._keras_mp_global_policy.compute_dtype
                policy = _with_dtypes(
                    policy, self, policy.compute_dtype, compute
                )
            self.dtype_policy = policy
            self._keras_mp_precision_rule = str(rule)
            fp8_layers.check_layer(self)
        ruled = rule is not None and rule.policy is not None
        fp8_layers.decide(self, ruled=ruled)

    __init__._keras_mp_hook = True
    keras.layers.Layer.__init__ = __init__


def _walk_with_parents(layer, seen=None):
    """`walk_layers(layer, into_models=False)`, each with the layer that
    holds it (None for `layer`'s own)."""
    seen = {id(layer)} if seen is None else seen
    for sublayer in layer._flatten_layers(include_self=False, recursive=False):
        if id(sublayer) in seen:
            continue
        seen.add(id(sublayer))
        yield sublayer, layer
        if not isinstance(sublayer, keras.Model):
            yield from _walk_with_parents(sublayer, seen)


def _inner_parent(parent):
    """`parent` when it is a layer whose own `call` consumes its sublayers'
    outputs (not a model), else None."""
    if parent is None or isinstance(parent, keras.Model):
        return None
    return parent


def _with_dtypes(policy, layer, compute, output):
    """`policy` fitted to `layer`, computing in `compute` and returning
    `output`."""
    policy = fitted_policy(policy, layer)
    if policy.compute_dtype == compute and (
        getattr(policy, "output_dtype", policy.compute_dtype) == output
    ):
        return policy
    variable = policy.variable_dtype
    return Policy(
        f"params={variable},compute={compute},output={output}",
        loss_scale=getattr(policy, "loss_scale", None),
        fp8=getattr(policy, "fp8", None),
    )


def _apply_rules(model):
    """Applies the rules that were active when each layer was created.

    Inside a layer (not a model), whose `call` is code of its own (`x +
    residual`), two more things hold. A layer a rule gives a policy
    returns the compute dtype of the layer that holds it, so that a
    float32 island hands bfloat16 back to a bfloat16 block. And where a
    rule gives a block another compute dtype, the layers inside it that no
    rule and no deliberate `dtype=` decide follow it.
    """
    outputs = output_layers(model)
    # The FP8 rules decide after every layer's policy is settled: NVFP4's
    # first and last blocks (`fp8_layers.mark_boundaries`) are known once
    # all of them are. A block is the layer the model holds directly.
    pending, blocks = [], {}
    for layer, parent in _walk_with_parents(model):
        blocks[id(layer)] = (
            layer if parent is model else blocks.get(id(parent), layer)
        )
        if not hasattr(layer, "_keras_mp_global_policy") or getattr(
            layer, "_keras_mp_rules_decided", False
        ):
            continue
        rules, is_output = layer._keras_mp_islands, id(layer) in outputs
        inner = _inner_parent(parent)
        rule = None
        if rules is not None:
            rule = rules._match(layer, layer_path(layer), is_output)
        ruled = rule is not None and rule.policy is not None
        described = None if rule is None else str(rule)
        if ruled:
            policy = fitted_policy(rule.policy, layer)
            _warn_if_overriding_a_map_entry(layer, rule)
            if inner is not None:
                policy = _with_dtypes(
                    policy, layer, policy.compute_dtype, inner.compute_dtype
                )
        else:
            policy = layer._keras_mp_global_policy
            followed = _followed_block(layer, inner)
            if followed is not None:
                ruled, described = True, followed
                compute = inner.compute_dtype
                policy = _with_dtypes(policy, layer, compute, compute)
        if policy is not layer.dtype_policy:
            _set_policy(layer, fitted_policy(policy, layer))
        layer._keras_mp_precision_rule = described
        pending.append((layer, blocks[id(layer)], is_output, ruled))
    fp8_layers.mark_boundaries(pending)
    for layer, _, is_output, ruled in pending:
        fp8_layers.decide(layer, is_output, ruled=ruled)
        # Once: a second model built on these layers (a feature extractor
        # whose outputs are inner layers) must not change the first one.
        layer._keras_mp_rules_decided = True
    model._keras_mp_rules_applied = True
    fp8_layers.check_model(model)


def _followed_block(layer, parent):
    """The rule (as `explain_precision` shows it) that `layer` follows as a
    layer inside a block a rule gave another compute dtype, or None."""
    if parent is None:
        return None
    rule = getattr(parent, "_keras_mp_precision_rule", None)
    own = policy_module.layer_policy(layer)
    if rule is None or parent.compute_dtype == own.compute_dtype:
        return None
    if " (inside " in rule:
        return rule
    return f"{rule} (inside {layer_path(parent)})"


def _warn_if_overriding_a_map_entry(layer, rule):
    """Warns when `rule` overrides a global `DTypePolicyMap`'s own entry for
    `layer` with other dtypes: the rule wins, and says so."""
    policy_map = layer._keras_mp_global_policy
    if not isinstance(policy_map, keras.dtype_policies.DTypePolicyMap):
        return
    path = layer_path(layer)
    if not any(key == path or re.fullmatch(key, path) for key in policy_map):
        return
    entry, ruled = policy_map[path], fitted_policy(rule.policy, layer)
    dtypes = [
        (
            p.variable_dtype,
            p.compute_dtype,
            getattr(p, "output_dtype", p.compute_dtype),
        )
        for p in (entry, ruled)
    ]
    if dtypes[0] == dtypes[1]:
        return
    warnings.warn(
        f"Layer {path!r} has an entry ({entry.name}) in the global "
        f"DTypePolicyMap and matches the float32 islands rule '{rule}': the "
        f"rule wins, so the layer computes as {ruled.name}. To keep the "
        "map's entry, add a rule giving it None (keep the global policy): "
        f"keras_mp.precision_rules({{{path!r}: None}}, base=...).",
        UserWarning,
        stacklevel=2,
    )


def _after_call(operation, outputs):
    if (
        isinstance(operation, keras.Model)
        and not isinstance(operation, _keras_internals.Functional)
        and not getattr(operation, "_keras_mp_rules_applied", False)
        and hasattr(operation, "_keras_mp_global_policy")
        and operation.built
    ):
        _apply_rules(operation)
    return outputs


# The key, beside a model's `config` in a saved model, of the decisions
# `_record` writes and `_restore` applies.
RECORD_KEY = "keras_mp_precision"


def _decided(layer):
    return hasattr(layer, "_keras_mp_global_policy") or getattr(
        layer, "_keras_mp_restored", False
    )


def _record(obj):
    """The precision decisions of a model's layers, for its saved config.

    A model rebuilt from its constructor's arguments (keras-hub's tasks
    and backbones, any subclassed model) rebuilds its layers with the
    `dtype` it passes them, not with the policies the rules, islands and
    FP8 rules gave them. So a model one of whose layers keras_mp decided
    saves, beside its `config`, each layer's policy, rule, FP8 reason and
    whether its policy was a deliberate `dtype=`, in
    `walk_layers(model, into_models=False)` order (a nested model saves
    its own), and `_restore` applies them when `load_model` rebuilds it.
    A functional model's layers already carry their policies in their
    configs; the record agrees with them.
    """
    if not isinstance(obj, keras.Model):
        return None
    layers = list(walk_layers(obj, into_models=False))
    if not any(_decided(layer) for layer in layers):
        return None
    policies, entries = [], []
    for layer in layers:
        index = None
        policy = layer.dtype_policy
        if not isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            config = keras.dtype_policies.serialize(policy)
            if config not in policies:
                policies.append(config)
            index = policies.index(config)
        entries.append(
            [
                type(layer).__name__,
                index,
                getattr(layer, "_keras_mp_precision_rule", None),
                getattr(layer, "_keras_mp_fp8_reason", None),
                given_dtype(layer),
            ]
        )
    return {"policies": policies, "layers": entries}


def _restore(model, record):
    """Gives a rebuilt model's layers the policies `_record` saved.

    The layers must be the saved ones, class by class, in order: where
    they are not (the model's code changed), nothing is applied and a
    warning says so.
    """
    if not isinstance(model, keras.Model) or not isinstance(record, dict):
        return
    layers = list(walk_layers(model, into_models=False))
    saved = [entry[0] for entry in record["layers"]]
    rebuilt = [type(layer).__name__ for layer in layers]
    if saved != rebuilt:
        warnings.warn(
            f"Model {model.name!r} was saved with keras_mp's precision "
            f"decisions for {len(saved)} layers, but its rebuilt layers "
            f"({len(rebuilt)}) are not those classes in that order, so "
            "they keep "
            "the dtypes of their constructor arguments (no float32 islands "
            "and no FP8 recipes restored). Rebuild the model with the code "
            "that saved it, or build it under "
            "`keras_mp.set_global_policy(...)` and load its weights.",
            UserWarning,
            stacklevel=2,
        )
        return
    policies = [
        keras.dtype_policies.deserialize(config)
        for config in record["policies"]
    ]
    for layer, entry in zip(layers, record["layers"]):
        _, index, rule, reason, dtype_argument = entry
        current = layer.dtype_policy
        if index is not None and not isinstance(
            current, keras.dtype_policies.DTypePolicyMap
        ):
            policy = policies[index]
            if type(current) is not type(policy) or current != policy:
                _set_policy(layer, policy)
        layer._keras_mp_precision_rule = rule
        layer._keras_mp_fp8_reason = reason
        # As `explain_precision` named it when it was saved: a layer that
        # was given the model's policy as `dtype=` got it from the rules.
        if dtype_argument:
            _given_dtype.add(layer)
        else:
            _given_dtype.discard(layer)
        layer._keras_mp_restored = True
    fp8_layers.check_model(model)


_install_layer_init_hook()
_keras_internals.install_functional_init_hook(_apply_rules)
_keras_internals.install_call_hook("precision_rules", _after_call)
_keras_internals.install_model_serialization(
    RECORD_KEY, _record, _restore, _deserializing
)


def check_model(model):
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "Expected a Keras model or layer. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )
