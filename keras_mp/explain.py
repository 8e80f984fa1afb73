"""`explain_precision`: each layer's dtypes, FP8 recipe, and why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from keras_mp import fp8_layers
from keras_mp import policy as policy_module
from keras_mp.precision import PrecisionRules
from keras_mp.precision import check_model
from keras_mp.precision import fitted_policy
from keras_mp.precision import given_dtype
from keras_mp.precision import layer_path
from keras_mp.precision import output_layers
from keras_mp.precision import resolve_rules
from keras_mp.precision import walk_layers


def explain_precision(
    model: keras.layers.Layer,
    rules: PrecisionRules | str | None = None,
    print_fn: Callable[[str], object] | None = print,
) -> list[dict[str, Any]]:
    """Prints, per layer, its variable, compute and output dtypes and why.

    The answer to "why is this layer float32?": the rule that gave each
    layer its policy (see `precision_rules`), or where the policy came from
    otherwise: the global policy at creation, or the layer's own
    deliberate `dtype` ("dtype argument"; a `dtype=` that hands on the
    global policy in force, as keras-hub's layers do, leaves the layer to
    the rules). Layers reloaded with `load_model` show the rules they were
    saved with; layers rebuilt otherwise from a config show "dtype
    argument": pass the rules to name the one that matches them.

    Args:
        model: A Keras model (Sequential, functional or subclassed) or layer.
        rules: A `PrecisionRules` (or `"default"`) to attribute the dtypes of
            layers that no active rule set, such as layers of a reloaded
            model. Defaults to None.
        print_fn: Called with the table as one string; None prints nothing.
            Defaults to `print`.

    Returns:
        A list with one dict per layer (depth first, as `model.summary`
        nests): `layer` (its path, or its name for layers without weights),
        `class_name`, `variable_dtype`, `compute_dtype`, `output_dtype`,
        `rule` and `fp8`: the layer's FP8 recipe as
        `"scaling/granularity/formats"` (e.g. `"current/tensorwise/hybrid"`;
        `" margin=1"` and `" +stats"` follow where the recipe has them),
        or why it has none: `"output layer"`, `"embedding"`, `"no GEMM"`,
        `"dims 10x3 not multiples of 16"` (what `keras_mp.fp8.DEFAULT_RULES`
        skipped), `"precision rule"` (a rule gave it a policy), or `"off"`.
        The table has the `fp8` column when some layer has a recipe or
        was left to the FP8 rules.

    Example:

    >>> policy = keras_mp.Policy("p=f32,c=bf16,o=f32")
    >>> layer = keras.layers.Dense(2, dtype=policy)
    >>> rows = keras_mp.explain_precision(layer, print_fn=None)
    >>> [(row["compute_dtype"], row["output_dtype"]) for row in rows]
    [('bfloat16', 'float32')]
    """
    check_model(model)
    rules = resolve_rules(rules, "rules")
    layers = [model, *walk_layers(model, into_models=True)]
    outputs = output_layers(model)
    rows, uses_fp8 = [], False
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        policy = policy_module.layer_policy(layer)
        output_dtype = getattr(policy, "output_dtype", policy.compute_dtype)
        rows.append(
            {
                "layer": layer_path(layer),
                "class_name": type(layer).__name__,
                "variable_dtype": policy.variable_dtype,
                "compute_dtype": policy.compute_dtype,
                "output_dtype": output_dtype,
                "rule": _reason(layer, policy, rules, id(layer) in outputs),
                "fp8": fp8_layers.describe(layer, policy),
            }
        )
        uses_fp8 = (
            uses_fp8
            or fp8_layers.considered(layer)
            or (getattr(policy, "fp8", None) is not None)
        )
    if print_fn is not None:
        print_fn(_table(rows, with_fp8=uses_fp8))
    return rows


def _reason(layer, policy, rules, is_output):
    recorded = getattr(layer, "_keras_mp_precision_rule", None)
    if recorded is not None:
        return recorded
    if rules is not None:
        rule = rules._match(layer, layer_path(layer), is_output)
        if rule is not None and rule.policy is not None:
            expected = fitted_policy(rule.policy, layer)
            if (
                expected.compute_dtype == policy.compute_dtype
                and expected.output_dtype
                == getattr(policy, "output_dtype", policy.compute_dtype)
            ):
                return str(rule)
    if given_dtype(layer):
        return "dtype argument"
    return "global policy"


def _table(rows, with_fp8):
    header = {
        "layer": "layer",
        "class_name": "class",
        "variable_dtype": "variable",
        "compute_dtype": "compute",
        "output_dtype": "output",
        "rule": "rule",
    }
    if with_fp8:
        header["fp8"] = "fp8"
    keys = list(header)
    widths = {
        key: max(len(str(row[key])) for row in [header, *rows]) for key in keys
    }
    lines = []
    for row in [header, *rows]:
        cells = [str(row[key]).ljust(widths[key]) for key in keys]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * widths[key] for key in keys))
    return "\n".join(lines)
