"""Which layers run FP8: a layer's recipe, the default rules' decision for
a considered layer (`consider`, `decide`), the FP8 column of
`explain_precision` (`describe`) and the check of a recipe a layer cannot
take (`check_layer`).
"""

import keras

from keras_mp import _keras_internals
from keras_mp import policy as policy_module
from keras_mp._fp8 import rules as rules_module
from keras_mp.policy import Policy

has_gemm = rules_module.has_gemm


def layer_recipe(layer):
    """The FP8 recipe of `layer`'s policy (its map entry), or None."""
    policy = policy_module.layer_policy(layer)
    return policy.fp8 if isinstance(policy, Policy) else None


def with_recipe(policy, recipe):
    """`policy` as a keras_mp `Policy` whose GEMMs follow `recipe`."""
    loss_scale = policy.loss_scale if isinstance(policy, Policy) else "auto"
    return Policy(policy.name, loss_scale=loss_scale, fp8=recipe)


def consider(layer, recipe):
    """Marks a layer created under `set_global_policy(..., fp8=recipe)`.

    The default rules then decide for it (`decide`) when it is created,
    when it builds (its dimensions are known) and when its model is built
    (its output layers are known).
    """
    layer._keras_mp_fp8_rules_recipe = recipe


def decide(layer, is_output=None, ruled=False):
    """Gives a considered layer the default rules' recipe, or takes it back.

    Args:
        layer: A layer `consider` marked; others are left alone.
        is_output: Whether it produces its model's outputs; None keeps
            what the last decision knew. Defaults to None.
        ruled: A precision rule gave the layer its policy, which wins over
            the FP8 rules. Defaults to `False`.
    """
    recipe = getattr(layer, "_keras_mp_fp8_rules_recipe", None)
    if recipe is None:
        return
    if ruled:
        layer._keras_mp_fp8_rules_recipe = None
        layer._keras_mp_fp8_reason = "precision rule"
        return
    if not rules_module.has_gemm(layer):
        return
    if is_output is None:
        is_output = getattr(layer, "_keras_mp_fp8_output", False)
    layer._keras_mp_fp8_output = is_output
    base = entry = layer._keras_mp_global_policy
    if isinstance(base, keras.dtype_policies.DTypePolicyMap):
        if layer.path is None:
            return  # Its entry is known once it builds.
        entry = base[layer.path]
        if isinstance(entry, Policy) and entry.fp8 is not None:
            # The map's own recipe for this path: asked for explicitly.
            layer._keras_mp_fp8_rules_recipe = None
            return
    rules = rules_module.DEFAULT_RULES
    position = getattr(layer, "_keras_mp_fp8_boundary", None)
    boundary = None
    if position is not None:
        compute = entry.compute_dtype
        boundary = rules.high_precision_reason(recipe, position, compute)
    reason = rules.skip_reason(layer, recipe, is_output, boundary)
    layer._keras_mp_fp8_reason = reason
    target = base if reason else with_recipe(entry, recipe)
    _keras_internals.replace_layer_policy(layer, target)


def mark_boundaries(entries):
    """Marks the GEMM layers of a model's first and last blocks, which the
    default rules keep in the compute dtype under NVFP4
    (`Rules.high_precision_blocks`); `decide` then gives them the reason.

    Args:
        entries: `(layer, block, is_output, ruled)` for each layer of the
            model about to be decided, in the order the model tracks them:
            `block` the layer the model holds directly that holds it (or
            it itself), `ruled` whether a precision rule gave it its
            policy.
    """
    rules = rules_module.DEFAULT_RULES
    blocks, recipes = {}, {}
    for layer, block, is_output, ruled in entries:
        recipe = getattr(layer, "_keras_mp_fp8_rules_recipe", None)
        if (
            recipe is None
            or ruled
            or not rules_module.has_gemm(layer)
            or rules.skip_reason(layer, recipe, is_output) is not None
        ):
            continue
        blocks.setdefault(id(block), []).append(layer)
        recipes.setdefault(recipe, []).append(id(block))
    for recipe, ids in recipes.items():
        ordered = list(dict.fromkeys(ids))
        positions = rules.high_precision_blocks(recipe, len(ordered))
        for index, position in positions.items():
            for layer in blocks[ordered[index]]:
                if layer._keras_mp_fp8_rules_recipe == recipe:
                    layer._keras_mp_fp8_boundary = position


def describe(layer, policy):
    """The FP8 column of `explain_precision`: the recipe, or why none."""
    recipe = policy.fp8 if isinstance(policy, Policy) else None
    if recipe is not None:
        text = f"{recipe.scaling}/{recipe.granularity}/{recipe.formats}"
        if recipe.scaling == "delayed":
            text += f" history={recipe.amax_history} {recipe.amax_algo}"
        if recipe.margin:
            text += f" margin={recipe.margin}"
        if recipe.scale_rounding not in (None, "rceil"):
            text += f" scale_rounding={recipe.scale_rounding}"
        if recipe.high_precision is not None:
            text += f" {recipe.high_precision} in high precision"
        if recipe.stochastic_rounding is False:
            text += " no stochastic rounding"
        if recipe.hadamard is False:
            text += " no hadamard"
        if recipe.save_activations != "input":
            text += f" saves {recipe.save_activations} activations"
        return text + (" +stats" if recipe.stats else "")
    reason = getattr(layer, "_keras_mp_fp8_reason", None)
    if reason is not None:
        return reason
    if isinstance(layer, keras.layers.Embedding):
        return "embedding"
    if not rules_module.has_gemm(layer):
        return "no GEMM"
    return "off"


def considered(layer):
    """Whether the default FP8 rules decided (or will decide) for `layer`."""
    return (
        getattr(layer, "_keras_mp_fp8_rules_recipe", None) is not None
        or getattr(layer, "_keras_mp_fp8_reason", None) is not None
    )


def check_layer(layer):
    """Raises ValueError when `layer`'s policy gives it a recipe it cannot
    take (it has no GEMM; block tiles that its dimensions do not fill)."""
    rules_module.check_layer(layer, layer_recipe(layer))
