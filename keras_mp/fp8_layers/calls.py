"""The `Dense.call` and `EinsumDense.call` hooks: a layer with an FP8
recipe runs its GEMM with `fp8.dot` / `fp8.einsum` (a frozen layer on its
stored codes), then its LoRA path, bias and activation in the compute
dtype; every other layer runs Keras's call unchanged.
"""

import functools

import keras
import numpy as np

from keras_mp._fp8 import quantizers
from keras_mp._fp8 import rules as rules_module
from keras_mp._fp8.dot import dot
from keras_mp._fp8.einsum import einsum
from keras_mp._fp8.einsum import kernel_matrix
from keras_mp.backend import fp8 as backend_fp8
from keras_mp.fp8_layers import lora
from keras_mp.fp8_layers.decisions import layer_recipe
from keras_mp.fp8_layers.state import delayed_scaling
from keras_mp.fp8_layers.state import static_state
from keras_mp.fp8_layers.state import stats_input
from keras_mp.fp8_layers.state import stored


def _static_output(layer, recipe, inputs, training, equation=None):
    """A frozen layer's GEMM: the kernel its recipe's quantizer gives back
    from the stored codes and scales (`Quantizer.kernel_from_frozen`),
    multiplied as that quantizer says (the same FP8 GEMM `fp8.dot` runs,
    on the same values). For inference only."""
    if training:
        raise ValueError(
            f"Layer {layer.name!r} was frozen for inference by "
            "`keras_mp.fp8.freeze`: its kernel is stored as FP8 codes and "
            "cannot train. Received: a call with training=True. Train the "
            "model before freezing it, and use the frozen one with "
            "`predict` or `model(x)`."
        )
    state = {name: stored(v) for name, v in static_state(layer).items()}
    quantizer = quantizers.get(recipe)
    kernel, arguments = quantizer.kernel_from_frozen(state, recipe)
    if quantizer.frozen_layout == "matrix":
        kernel = _layer_kernel(layer, kernel, equation)
    return _gemm(
        equation,
        inputs,
        kernel,
        output_dtype=layer.compute_dtype,
        **arguments,
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
        return dot(inputs, kernel, **kwargs)
    return einsum(equation, inputs, kernel, **kwargs)


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
