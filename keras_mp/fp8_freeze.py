"""`keras_mp.fp8.freeze`: an FP8 model made an inference model.

Each FP8 Dense and EinsumDense gets `Recipe(scaling="static")`: its kernel
(LoRA merged in first) is stored as FP8 E4M3 codes (one byte a value, half
of bfloat16's) and a power-of-two scale, its input scale is fixed, and its
float32 kernel is gone (MXFP8 and NVFP4 layers: their own codes and block
scales, and no input scale). A frozen layer runs the same FP8 GEMM as in
training, forward only, and saves and reloads (`.keras`, `.weights.h5`)
as such.
"""

import keras
import numpy as np

from keras_mp import _keras_internals
from keras_mp import fp8_layers
from keras_mp import policy as policy_module
from keras_mp._fp8 import delayed as delayed_module
from keras_mp._fp8 import quantizers
from keras_mp._fp8 import stats as stats_module
from keras_mp._fp8.einsum import kernel_matrix
from keras_mp._fp8.formats.e4m3_e5m2 import scale_from_amax
from keras_mp._fp8.recipe import Recipe
from keras_mp.policy import Policy


def _scale(amax, margin):
    """The E4M3 power-of-two scale of `amax`, as a NumPy float32."""
    scale = scale_from_amax(np.float32(amax), "e4m3", margin)
    return np.float32(keras.ops.convert_to_numpy(scale))


def _input_scale(layer, recipe):
    """The input scale training left: the delayed history's, or that of
    the last step's statistics; None when neither is known."""
    state = fp8_layers.delayed_state(layer)
    if state and int(keras.ops.convert_to_numpy(state["fp8_steps"])) > 0:
        history = keras.ops.convert_to_numpy(state["fp8_amax_history"])
        return float(
            keras.ops.convert_to_numpy(
                delayed_module.history_scales(history, recipe)[0]
            )
        )
    carrier = stats_module.layer_carrier(layer)
    if carrier is None or not layer.trainable:
        return None
    values = keras.ops.convert_to_numpy(carrier)
    bins = np.flatnonzero(values[0, : stats_module.FINITE_BINS])
    if not values[0, stats_module.COUNT] or not len(bins):
        return None
    return _scale(stats_module.bin_amax(bins[-1]), recipe.margin)


def _calibrated_scales(model, layers, calibration_data):
    """Runs `model` on `calibration_data` (eagerly) and returns each
    layer's input scale from the largest amax its calls saw."""
    for layer in layers:
        layer._keras_mp_fp8_calibration = []
    try:
        model(calibration_data, training=False)
        amaxes = {
            layer: max(layer._keras_mp_fp8_calibration, default=None)
            for layer in layers
        }
    finally:
        for layer in layers:
            layer._keras_mp_fp8_calibration = None
    uncalled = [layer.name for layer, amax in amaxes.items() if amax is None]
    if uncalled:
        raise ValueError(
            "`calibration_data` did not reach every FP8 layer that needs an "
            f"input scale. Received: no call of {uncalled}. Pass inputs "
            "that run through the whole model."
        )
    return {
        layer: _scale(amax, fp8_layers.layer_recipe(layer).margin)
        for layer, amax in amaxes.items()
    }


def _merged_kernel(layer):
    """The float32 kernel the layer multiplies, LoRA's update merged."""
    with _keras_internals.without_autocast():
        return keras.ops.convert_to_numpy(
            keras.ops.cast(layer.kernel, "float32")
        )


def _drop_lora(layer):
    if getattr(layer, "lora_enabled", False):
        for variable in (layer.lora_kernel_a, layer.lora_kernel_b):
            _keras_internals.untrack_variable(layer, variable)
        layer.lora_kernel_a = layer.lora_kernel_b = None
        layer.lora_enabled = False
        layer.lora_rank = None


def _gemm_matrix(layer, kernel):
    """The kernel as its layer's GEMM multiplies it: `[K, N]`."""
    if isinstance(layer, keras.layers.EinsumDense):
        permutation, k, n = kernel_matrix(layer.equation, kernel.shape)
        kernel = np.transpose(kernel, permutation).reshape(k, n)
    return kernel


# The fields a frozen layer's recipe keeps from its training recipe.
_STATIC_FIELDS = (
    "formats",
    "margin",
    "scale_rounding",
    "stochastic_rounding",
    "hadamard",
)


def _static_recipe(recipe):
    """`Recipe(scaling="static")` of the format `recipe` trained with: of
    its granularity where its quantizer stores a frozen kernel itself,
    else tensorwise (rowwise and block kernels freeze as E4M3 codes and
    one scale)."""
    config = recipe.get_config()
    kept = {name: config[name] for name in _STATIC_FIELDS if name in config}
    if quantizers.get(recipe).freezes:
        kept["granularity"] = recipe.granularity
    return Recipe(scaling="static", **kept)


def freeze(model, calibration_data=None):
    """Makes a trained FP8 model an inference model, in place.

    Every Dense and EinsumDense with an FP8 recipe gets
    `keras_mp.fp8.Recipe(scaling="static")`: its kernel, with a LoRA
    update merged in first, is stored as FP8 E4M3 codes (a uint8 variable,
    `fp8_kernel_codes`: half of a bfloat16 kernel's bytes) and its
    power-of-two scale (`fp8_kernel_scale`); its input scale
    (`fp8_input_scale`) is fixed. An MXFP8 layer
    (`Recipe(formats="mxfp8")`) stores the codes of its GEMM's `[K, N]`
    kernel and their E8M0 block scales along K (uint8, `[K / 32, N]`:
    1.03 bytes a weight) and scales each call's input by its own blocks,
    as in training, so it needs no input scale. An NVFP4 layer
    (`Recipe(formats="nvfp4")`) stores its GEMM's `[K, N]` kernel as
    training's forward quantizes it (16x16 tiles, round to nearest even):
    E2M1 codes two a byte along K (uint8 `[K / 2, N]`, the first code of
    a pair in the low nibble), the tiles' E4M3 scales (uint8 bits,
    `[K / 16, N / 16]`) and the float32 tensor scale
    (`fp8_kernel_tensor_scale`): 0.504 bytes a weight; its GEMM takes
    those values as they are, and each call's input is quantized as in
    training. A layer's float32 kernel, statistics carrier and delayed
    state are removed. A frozen layer runs the FP8 GEMM it
    trained with, forward only, and raises if called with
    `training=True`. The model saves and reloads (`.keras`,
    `.weights.h5` into a frozen model) and predicts as it did.

    The input scale comes from the layer's training: the delayed
    history's scale (`scaling="delayed"`), or that of the last step's
    statistics (`stats=True`); other layers need `calibration_data`, on
    which the model runs once, each layer's scale then fitting the
    largest input it saw. Inputs beyond it later saturate (are clipped to
    E4M3's 448 times the scale).

    Args:
        model: A built Keras model (or layer) with FP8 layers.
        calibration_data: Inputs of `model` (one batch, as `model(x)`
            takes it), used only for layers whose training left no input
            scale. Defaults to `None`.

    Returns:
        `model`, frozen.

    Raises:
        ValueError: no FP8 layer; a layer needs `calibration_data` and
            none was given; a layer is frozen already.
    """
    layers = [
        layer
        for layer in _keras_internals.all_layers(model)
        if fp8_layers.layer_recipe(layer) is not None
        and fp8_layers.has_gemm(layer)
        and layer.built
    ]
    if not layers:
        raise ValueError(
            "`keras_mp.fp8.freeze` freezes the FP8 layers of a built model, "
            f"and this one has none. Received: model={model.name!r}. Train "
            "it with FP8 first, e.g. under `keras_mp.set_global_policy("
            "'mixed_bfloat16', fp8=True)`."
        )
    unquantized = [
        layer.name
        for layer in layers
        if fp8_layers.layer_recipe(layer).high_precision == "forward"
    ]
    if unquantized:
        raise ValueError(
            "`keras_mp.fp8.freeze` stores the kernels of FP8 forward GEMMs; "
            f"layers {unquantized} run their forward GEMM in high precision "
            "(`Recipe(high_precision='forward')`), so freezing them to FP8 "
            "codes would change their outputs. Received: those layers. "
            "Keep them as they are for inference."
        )
    frozen = [
        layer.name
        for layer in layers
        if fp8_layers.layer_recipe(layer).scaling == "static"
    ]
    if frozen:
        raise ValueError(
            f"Layers {frozen} are frozen already. Received: model="
            f"{model.name!r}. Freeze the trained model once."
        )
    static = {
        layer: _static_recipe(fp8_layers.layer_recipe(layer))
        for layer in layers
    }
    # MXFP8 and NVFP4 scale each call's input by its own blocks: no
    # input scale.
    scales = {
        layer: _input_scale(layer, fp8_layers.layer_recipe(layer))
        for layer in layers
        if quantizers.get(static[layer]).frozen_input_scale
    }
    missing = [layer for layer, scale in scales.items() if scale is None]
    if missing and calibration_data is None:
        raise ValueError(
            "These FP8 layers ran current scaling without statistics of "
            "their own (a frozen, trainable=False, layer counts none), so "
            "their training left no input scale to freeze: "
            f"{[layer.name for layer in missing]}. Received: "
            "calibration_data=None. Pass `calibration_data=x` (inputs of "
            "the model), or train with `keras_mp.fp8.Recipe(stats=True)` "
            "or `scaling='delayed'`."
        )
    if missing:
        scales.update(_calibrated_scales(model, missing, calibration_data))
    for layer in layers:
        quantizer = quantizers.get(static[layer])
        kernel = _merged_kernel(layer)
        if quantizer.frozen_layout == "matrix":
            kernel = _gemm_matrix(layer, kernel)
        values = quantizer.freeze_kernel(
            kernel, static[layer], scales.get(layer)
        )
        _drop_lora(layer)
        policy = Policy(
            policy_module.layer_policy(layer).name,
            loss_scale=None,
            fp8=static[layer],
        )
        _keras_internals.replace_layer_policy(layer, policy)
        fp8_layers.sync_stats_carrier(layer)
        state = fp8_layers.static_state(layer)
        for name, value in values.items():
            state[name].assign(value)
        layer.trainable = False
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    return model
