"""The `Dense.call` and `EinsumDense.call` hooks: a layer with an FP8
recipe runs its GEMM with `fp8.dot` / `fp8.einsum` (a frozen layer on its
stored codes), then its LoRA path, bias and activation in the compute
dtype; every other layer runs Keras's call unchanged.
"""

import functools

import keras
import ml_dtypes
import numpy as np

from keras_mp import fp8
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.fp8 import delayed as delayed_module
from keras_mp.fp8 import rules as rules_module
from keras_mp.fp8.einsum import kernel_matrix
from keras_mp.fp8.formats import mxfp8
from keras_mp.fp8.formats import nvfp4
from keras_mp.fp8.recipe import NV_FORMATS
from keras_mp.fp8_layers import lora
from keras_mp.fp8_layers.decisions import layer_recipe
from keras_mp.fp8_layers.state import delayed_scaling
from keras_mp.fp8_layers.state import static_state
from keras_mp.fp8_layers.state import stats_input
from keras_mp.fp8_layers.state import stored

# The float32 value of each E4M3 code, by its bit pattern.
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
_E4M3_VALUES = _E4M3_VALUES.astype(np.float32)


def _static_output(layer, recipe, inputs, training, equation=None):
    """A frozen layer's GEMM: the input quantized with its fixed scale, the
    stored kernel codes with theirs (the same FP8 GEMM `fp8.dot` runs, on
    the same codes). For inference only."""
    if training:
        raise ValueError(
            f"Layer {layer.name!r} was frozen for inference by "
            "`keras_mp.fp8.freeze`: its kernel is stored as FP8 codes and "
            "cannot train. Received: a call with training=True. Train the "
            "model before freezing it, and use the frozen one with "
            "`predict` or `model(x)`."
        )
    state = static_state(layer)
    if recipe.formats in NV_FORMATS:
        return _static_nv_output(layer, recipe, inputs, state, equation)
    if recipe.scale_rounding is not None:
        return _static_mx_output(layer, recipe, inputs, state, equation)
    ops = keras.ops
    codes = ops.cast(stored(state["fp8_kernel_codes"]), "int32")
    kernel_scale = stored(state["fp8_kernel_scale"])
    kernel = ops.take(_E4M3_VALUES, codes) * kernel_scale
    scaling = delayed_module.Scaling(
        scales=ops.stack([stored(state["fp8_input_scale"]), kernel_scale, 1.0]),
        first=ops.convert_to_tensor(False),
        parity=ops.zeros((2,), "float32"),
        loss_scale=ops.convert_to_tensor(1.0, "float32"),
    )
    gemm_recipe = fp8.Recipe(
        scaling="delayed", formats=recipe.formats, margin=recipe.margin
    )
    kwargs = dict(
        recipe=gemm_recipe,
        output_dtype=layer.compute_dtype,
        stats=ops.zeros(delayed_module.CARRIER_SHAPE, "float32"),
        delayed=scaling,
    )
    return _gemm(equation, inputs, kernel, **kwargs)


def _static_mx_output(layer, recipe, inputs, state, equation):
    """A frozen MXFP8 layer's GEMM: its stored codes and E8M0 scales
    dequantized to the kernel, whose quantization along K gives back the
    same values, and the input quantized by the call, as in training."""
    ops = keras.ops
    codes = ops.take(
        _E4M3_VALUES, ops.cast(stored(state["fp8_kernel_codes"]), "int32")
    )
    matrix = mxfp8.dequantize(
        ops.cast(codes, "float8_e4m3fn"), stored(state["fp8_kernel_scale"]), 0
    )
    current = fp8.Recipe(
        formats=recipe.formats, scale_rounding=recipe.scale_rounding
    )
    return _gemm(
        equation,
        inputs,
        _layer_kernel(layer, matrix, equation),
        recipe=current,
        output_dtype=layer.compute_dtype,
    )


def _static_nv_output(layer, recipe, inputs, state, equation):
    """A frozen NVFP4 layer's GEMM: its packed E2M1 codes, E4M3 tile
    scales and tensor scale dequantized to the values training's forward
    multiplied, which the static recipe's GEMM takes as they are, and the
    input quantized by the call, as in training."""
    ops = keras.ops
    codes = nvfp4.unpack(stored(state["fp8_kernel_codes"]), 0)
    block = ops.take(
        _E4M3_VALUES, ops.cast(stored(state["fp8_kernel_scale"]), "int32")
    )
    tile = (nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)
    matrix = nvfp4.dequantize(
        codes,
        (block, stored(state["fp8_kernel_tensor_scale"])),
        block_shape=tile,
    )
    return _gemm(
        equation,
        inputs,
        _layer_kernel(layer, matrix, equation),
        recipe=recipe,
        output_dtype=layer.compute_dtype,
    )


def _layer_kernel(layer, matrix, equation):
    """The kernel of its layer's shape whose GEMM matrix is `matrix`."""
    if equation is None:
        return matrix
    shape = layer._keras_mp_fp8_kernel_shape
    permutation, _, _ = kernel_matrix(equation, shape)
    kernel = keras.ops.reshape(matrix, [shape[i] for i in permutation])
    return keras.ops.transpose(kernel, np.argsort(permutation).tolist())


def _gemm(equation, inputs, kernel, **kwargs):
    """`fp8.dot` for a `Dense` (`equation` None), else `fp8.einsum`."""
    if equation is None:
        return fp8.dot(inputs, kernel, **kwargs)
    return fp8.einsum(equation, inputs, kernel, **kwargs)


def _calibrate(layer, inputs):
    """Records the amax of a call's inputs while `fp8.freeze` calibrates."""
    amaxes = getattr(layer, "_keras_mp_fp8_calibration", None)
    if amaxes is not None:
        value = backend_fp8.amax(keras.ops.cast(inputs, "float32"), None)
        amaxes.append(float(keras.ops.convert_to_numpy(value).max()))


def _call_recipe(layer):
    """The recipe this call runs with, or None for Keras's own call."""
    recipe = layer_recipe(layer)
    if recipe is None:
        return None
    rules_module.check_layer(layer, recipe)
    return recipe


def _bias_and_activation(layer, x):
    if layer.bias is not None:
        x = keras.ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _fp8_output(layer, recipe, inputs, training, equation=None):
    """The FP8 call of a `Dense` (`equation` None) or `EinsumDense`: its
    GEMM (a frozen layer's on its stored codes), LoRA path, bias and
    activation."""
    _calibrate(layer, inputs)
    if recipe.scaling == "static":
        x = _static_output(layer, recipe, inputs, training, equation)
        return _bias_and_activation(layer, x)
    stats = stats_input(layer, recipe)
    kernel = lora.gemm_kernel(layer)
    kwargs = dict(
        recipe=recipe,
        output_dtype=layer.compute_dtype,
        stats=stats,
        delayed=delayed_scaling(layer, recipe, stats),
    )
    x = _gemm(equation, inputs, kernel, **kwargs)
    x = lora.add_lora(layer, inputs, x, equation)
    return _bias_and_activation(layer, x)


def _call_hook(original, equation):
    """`original` (Keras's `call`), or the FP8 call where the layer's
    policy has a recipe; `equation(layer)` gives the einsum equation, or
    None for a `Dense`."""

    @functools.wraps(original)
    def call(self, inputs, training=None):
        recipe = _call_recipe(self)
        if recipe is None:
            return original(self, inputs, training=training)
        return _fp8_output(self, recipe, inputs, training, equation(self))

    call._keras_mp_hook = True
    return call


def install_call_hooks():
    if getattr(keras.layers.Dense.call, "_keras_mp_hook", False):
        return
    keras.layers.Dense.call = _call_hook(
        keras.layers.Dense.call, lambda layer: None
    )
    keras.layers.EinsumDense.call = _call_hook(
        keras.layers.EinsumDense.call, lambda layer: layer.equation
    )
