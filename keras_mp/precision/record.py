"""The `keras_mp_precision` record: each layer's precision decision saved
beside a model's config (`_record`) and applied by `load_model` when it
rebuilds the model (`_restore`)."""

import warnings

import keras

from keras_mp import fp8_layers
from keras_mp.precision.apply import _given_dtype
from keras_mp.precision.apply import _set_policy
from keras_mp.precision.apply import given_dtype
from keras_mp.precision.rules import walk_layers

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
