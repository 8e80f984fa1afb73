"""Applying the rules: the layer-init hook (class rules and the FP8
rules at a layer's creation, a `dtype=` that hands on the policy in force
left to the rules), the functional-init and call hooks (path and `outputs`
rules once the model is known, islands inside a layer, a ruled block's
inner layers following it), and which layers were given a `dtype`."""

import contextlib
import functools
import re
import threading
import warnings
import weakref

import keras

from keras_mp import _keras_internals
from keras_mp import autocast
from keras_mp import fp8_layers
from keras_mp import policy as policy_module
from keras_mp.policy import Policy
from keras_mp.precision import global_policy as global_policy_module
from keras_mp.precision.rules import fitted_policy
from keras_mp.precision.rules import layer_path
from keras_mp.precision.rules import output_layers


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
        rules = global_policy_module.global_float32_islands()
        recipe = global_policy_module.global_fp8()
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
