"""`keras_mp.fp8.adopt`: Keras's float8 layers taken over by keras_mp's
delayed FP8 scaling, their amax histories kept.

On floor 4: it turns layers into the FP8 layers of `fp8_layers/`, which
`keras_mp.fp8` (floor 3) must not import, so the package's face
(`keras_mp/__init__.py`) puts `adopt` into `keras_mp.fp8`. Imports from
keras_mp only `_keras_internals`, `fp8`, `fp8_layers`, `policy`.
"""

import math
import numbers

import keras
import numpy as np

from keras_mp import _keras_internals
from keras_mp import fp8_layers
from keras_mp._fp8 import delayed as delayed_module
from keras_mp._fp8 import recipe as recipe_module
from keras_mp._fp8 import rules as rules_module
from keras_mp._fp8 import stats as stats_module
from keras_mp.policy import Policy

_FIX = (
    'Pass `recipe=keras_mp.fp8.Recipe(scaling="delayed", '
    "amax_history=...)`, or leave `recipe=None` for Keras's history length."
)


def adopt(model, recipe=None, loss_scale=None):
    """Takes over the layers `model.quantize("float8")` made, keeping their
    amax histories, so that delayed scaling's rules apply to them.

    Keras's float8 `Dense` and `EinsumDense` keep a scale and an amax
    history per tensor as trainable variables, which sum a layer's calls,
    run the first two steps at scale 1.0, never calibrate a frozen layer
    and store the output gradient's amax loss-scaled. `adopt` gives each
    such layer a `keras_mp.Policy` of the dtypes it was quantized from
    (e.g. `"mixed_bfloat16"`) with a delayed recipe, removes Keras's six
    float8 variables and starts keras_mp's delayed state
    (`fp8_amax_history`, `fp8_steps`, `fp8_scale`, non-trainable) from
    Keras's histories: the same amaxes, newest first, each stored as the
    value of its histogram bin, which has exactly that amax's
    power-of-two scale. A non-finite amax is dropped (keras_mp never
    writes one). With an amax in the history, the next step quantizes
    with the history's scales; with none (a layer Keras never trained), it
    runs current scaling, as keras_mp's first step does. Keras's own
    scales are not kept: keras_mp's are powers of two, from the history.

    Each layer is checked before any changes, so a layer that cannot be
    taken over leaves the model as it was. Other layers are left alone.
    The model's compiled step functions are dropped; compile the model
    again before training it: an optimizer built for Keras's variables
    knows none of keras_mp's.

    Args:
        model: A Keras model (or layer) with layers that
            `model.quantize("float8")` quantized.
        recipe: The `keras_mp.fp8.Recipe` the layers take, with
            `scaling="delayed"` (tensorwise). A history of another length
            than Keras's keeps its newest amaxes, or pads with zeros.
            Defaults to `None`: `Recipe(scaling="delayed",
            amax_history=<Keras's history length>)`.
        loss_scale: The loss scale Keras's output-gradient amaxes carry, a
            power of two: under Keras's `LossScaleOptimizer`, Keras 3.15
            stores the output gradient's amax multiplied by the loss scale
            (e.g. `float(optimizer.dynamic_scale)` of that optimizer;
            amaxes stored before its last change are off by that change).
            keras_mp's history is free of it; the amaxes are divided by it.
            Defaults to `None` (no loss scale).

    Returns:
        The list of layers taken over.

    Example:

    >>> model = keras.Sequential(
    ...     [keras.Input((16,)), keras.layers.Dense(32, name="dense")]
    ... )
    >>> model.quantize("float8")
    >>> [layer.name for layer in keras_mp.fp8.adopt(model)]
    ['dense']
    >>> layer = model.get_layer("dense")
    >>> layer.quantization_mode is None, layer.dtype_policy.fp8.scaling
    (True, 'delayed')
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "`keras_mp.fp8.adopt` takes a Keras model or layer. Received: "
            f'model={model!r}. Pass the model `model.quantize("float8")` '
            "quantized."
        )
    recipe = _check_recipe(recipe)
    loss_scale = _check_loss_scale(loss_scale)
    layers = [
        layer
        for layer in _keras_internals.all_layers(model)
        if layer.quantization_mode == "float8"
    ]
    if not layers:
        modes = sorted(
            {
                str(layer.quantization_mode)
                for layer in _keras_internals.all_layers(model)
            }
        )
        raise ValueError(
            "`keras_mp.fp8.adopt` takes a model with layers that Keras "
            "quantized to float8. Received: model="
            f"{model.name!r}, with no layer whose quantization_mode is "
            f"'float8' (its layers' modes: {modes}). Call "
            '`model.quantize("float8")` first, or give layers keras_mp\'s '
            "FP8 directly: `keras_mp.Policy(..., "
            'fp8=keras_mp.fp8.Recipe(scaling="delayed"))`.'
        )
    # Everything is checked and computed before the first layer changes.
    plans = [_plan(layer, recipe, loss_scale) for layer in layers]
    for layer, (policy, state) in zip(layers, plans, strict=True):
        _keras_internals.remove_float8_variables(layer)
        # Its policy is given here: the default FP8 rules no longer decide.
        fp8_layers.consider(layer, None)
        _keras_internals.replace_layer_policy(layer, policy)
        fp8_layers.sync_stats_carrier(layer)
        for name, variable in fp8_layers.delayed_state(layer).items():
            variable.assign(state[name])
    # As `Model.quantize` does: a traced step would still run Keras's
    # float8 GEMMs, and torch parameters would still hold its variables.
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    _keras_internals.retrack_torch_parameters(model)
    return layers


def _check_recipe(recipe):
    if recipe is None:
        return None
    if not isinstance(recipe, recipe_module.Recipe):
        raise TypeError(
            "`recipe` is a `keras_mp.fp8.Recipe` with delayed scaling. "
            f"Received: recipe={recipe!r}. {_FIX}"
        )
    if recipe.scaling != "delayed" or recipe.granularity != "tensorwise":
        raise ValueError(
            "`keras_mp.fp8.adopt` keeps Keras's amax histories, which only "
            "delayed tensorwise scaling reads. Received: recipe="
            f"{recipe!r}. {_FIX}"
        )
    return recipe


def _check_loss_scale(loss_scale):
    if loss_scale is None:
        return None
    value = loss_scale
    if not isinstance(value, numbers.Real):
        value = keras.ops.convert_to_numpy(value)
        value = value.item() if np.ndim(value) == 0 else None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
        or math.frexp(value)[0] != 0.5
    ):
        raise ValueError(
            "`loss_scale` is the loss scale Keras's output-gradient amaxes "
            "were multiplied by, a power of two, as every scale of Keras's "
            f"LossScaleOptimizer is. Received: loss_scale={loss_scale!r}. "
            "Pass that optimizer's `float(optimizer.dynamic_scale)`, or "
            "None when Keras trained without loss scaling."
        )
    return float(value)


def _plan(layer, recipe, loss_scale):
    """`(policy, state)` of a float8 layer once taken over; raises
    ValueError for a layer that cannot be."""
    if not rules_module.has_gemm(layer):
        raise ValueError(
            "`keras_mp.fp8.adopt` takes over Keras's float8 `Dense` and "
            f"`EinsumDense` layers. Received: layer {layer.name!r} of class "
            f"{type(layer).__name__}. Leave that layer out of the model "
            "given to adopt, or dequantize it first."
        )
    missing = [
        name
        for name in _keras_internals.FLOAT8_VARIABLE_NAMES
        if not isinstance(getattr(layer, name, None), keras.Variable)
    ]
    if missing:
        raise ValueError(
            f"Layer {layer.name!r} is quantized to float8 but lacks Keras's "
            f"float8 variables {missing}. Received: a layer that is not "
            "built, or not Keras's float8 Dense or EinsumDense. Build it "
            "(call the model once) and quantize it with "
            '`model.quantize("float8")`.'
        )
    histories = _keras_internals.float8_amax_histories(layer)
    if recipe is None:
        recipe = recipe_module.Recipe(
            scaling="delayed", amax_history=histories.shape[1]
        )
    policy = Policy(
        _keras_internals.float8_source_policy_name(layer), fp8=recipe
    )
    rules_module.check_layer(layer, recipe)
    return policy, _delayed_state(histories, recipe, loss_scale)


def _delayed_state(histories, recipe, loss_scale):
    """keras_mp's delayed state from Keras's histories (newest first)."""
    if loss_scale is not None:
        histories[2] /= np.float32(loss_scale)
    usable = np.isfinite(histories) & (histories > 0)
    amaxes = np.where(usable, histories, np.float32(0))
    length = recipe.amax_history
    kept = min(length, amaxes.shape[1])
    padded = np.zeros((amaxes.shape[0], length), "float32")
    padded[:, :kept] = amaxes[:, :kept]
    history = delayed_module.bin_value(stats_module.amax_bin(padded))
    history = keras.ops.convert_to_numpy(history)
    steps = int(history.any())
    if steps:
        scale = keras.ops.convert_to_numpy(
            delayed_module.history_scales(history, recipe)
        )
    else:
        scale = np.zeros((history.shape[0],), "float32")
    return {
        "fp8_amax_history": history,
        "fp8_steps": np.int32(steps),
        "fp8_scale": scale,
    }
